"""A tiny, fully deterministic training setup used by many tests (dropout + every RNG in play)."""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import torch

import safepoint


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Tiny(torch.nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(width, 2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Setup:
    def __init__(self, seed: int = 0, width: int = 16) -> None:
        seed_everything(seed)
        self.model = Tiny(width)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=3, gamma=0.5)
        self.extra: dict[str, object] = {"tokens_seen": 0, "note": "x"}

    def state(self, **kw: object) -> safepoint.TrainState:
        args: dict[str, object] = dict(
            model=self.model, optimizer=self.opt, scheduler=self.sched, extra=self.extra
        )
        args.update(kw)
        return safepoint.TrainState(**args)  # type: ignore[arg-type]

    def step(self) -> float:
        # Data drawn from all three RNGs so that any RNG not restored changes the result.
        x = torch.randn(4, 8) + float(np.random.rand()) + random.random()
        y = torch.randn(4, 2)
        loss = ((self.model(x) - y) ** 2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.extra["tokens_seen"] = int(self.extra["tokens_seen"]) + 4  # type: ignore[call-overload]
        return float(loss.detach())

    def snapshot(self) -> dict[str, torch.Tensor]:
        out = {f"model.{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        for pid, st in self.opt.state_dict()["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    out[f"opt.{pid}.{k}"] = v.clone()
        return out


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), f"{k} differs"


def train_until_preempted(
    mgr: safepoint.CheckpointManager, s: Setup, steps: range, *, term_at: int | None = None
) -> safepoint.Preempted | None:
    """maybe_save every step; SIGTERM ourselves after step ``term_at``; return the Preempted, if any."""
    for step in steps:
        s.step()
        if step == term_at:
            os.kill(os.getpid(), signal.SIGTERM)
        try:
            mgr.maybe_save(step, s.state())
        except safepoint.Preempted as e:
            return e
    return None


def big_state(mib: int, fill: float = 0.0) -> tuple[torch.nn.Module, safepoint.TrainState]:
    """One ``mib``-MiB parameter filled with ``fill``, in a TrainState without RNG."""
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.full((mib * 1024 * 1024 // 4,), fill))
    return m, safepoint.TrainState(model=m, rng=False)
