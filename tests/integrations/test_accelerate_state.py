"""accelerate_state: everything the accelerator prepared or registered round-trips through safepoint."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn

import safepoint
from safepoint.integrations.accelerate import ReplayLoader, accelerate_state

if TYPE_CHECKING:
    from accelerate import Accelerator

# accelerate is imported where an Accelerator is made: every xdist worker imports this module to collect
# it, and only the one that runs it should pay for the framework (safepoint's integration imports none).


class Counter:
    """A user object given to ``accelerator.register_for_checkpointing``."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]


def build() -> tuple[Accelerator, list[Any], Counter]:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    gen, disc = nn.Linear(4, 4), nn.Linear(4, 1)
    opt_g = torch.optim.AdamW(gen.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt_g, step_size=1, gamma=0.5)
    data = torch.utils.data.DataLoader(torch.arange(16.0).reshape(8, 2), batch_size=2, shuffle=True)
    prepared = list(acc.prepare(gen, disc, opt_g, opt_d, sched, data))
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return acc, prepared, counter


def step(prepared: list[Any]) -> None:
    gen, disc, opt_g, opt_d, sched, _ = prepared
    x = torch.randn(3, 4)
    (disc(gen(x)).sum()).backward()
    opt_g.step()
    opt_d.step()
    sched.step()


def test_models_optimizers_schedulers_registered_objects_and_step_round_trip(tmp_path: Path) -> None:
    acc, prepared, counter = build()
    loader = ReplayLoader(prepared[5])
    state = accelerate_state(acc, loader)
    assert state.sections() == [
        "model", "optimizer", "scheduler", "dataloader", "rng", "modules.model_1", "optimizers.model_1",
        "objects.accelerator", "objects.registered_0",
    ]  # fmt: skip
    for _ in range(3):
        step(prepared)
    next(iter(loader))
    counter.n, acc.step = 7, 2
    expected = [{k: v.clone() for k, v in m.state_dict().items()} for m in prepared[:2]]
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(3, state)

    acc2, prepared2, counter2 = build()
    loader2 = ReplayLoader(prepared2[5])
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.restore(accelerate_state(acc2, loader2)) == 3
    for model, want in zip(prepared2[:2], expected, strict=True):
        assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())
    assert prepared2[2].optimizer.state_dict()["state"][0]["step"] == 3  # AdamW's count, into fresh ones
    assert prepared2[3].optimizer.state_dict()["state"][0]["momentum_buffer"] is not None
    assert prepared2[4].scheduler.last_epoch == 3
    assert (counter2.n, acc2.step, loader2.epoch, loader2.batches) == (7, 2, 0, 1)


def test_refuses_an_accelerator_with_nothing_prepared() -> None:
    from accelerate import Accelerator

    with pytest.raises(ValueError, match="prepared no model"):
        accelerate_state(Accelerator(cpu=True))
    acc, prepared, _ = build()
    with pytest.raises(ValueError, match="must be a ReplayLoader"):
        accelerate_state(acc, prepared[5])


def test_the_documented_logger_hook_hears_of_an_async_save_only_once_it_is_committed(tmp_path: Path) -> None:
    """docs/frameworks/accelerate.md, 'Loggers': ``when_committed`` gives the committed step's directory."""
    acc, prepared, _ = build()
    state = accelerate_state(acc, ReplayLoader(prepared[5]))
    seen: list[tuple[int, str, bool]] = []

    def log_artifact(step: int, directory: str) -> None:  # a tracker's upload, in a real job
        seen.append((step, Path(directory).name, (Path(directory) / "safepoint.json").is_file()))

    with safepoint.CheckpointManager(tmp_path / "ckpt", save_every_steps=2, async_save=True) as mgr:
        mgr.events.subscribe(safepoint.when_committed(log_artifact))
        for n in range(1, 6):
            step(prepared)
            mgr.maybe_save(n, state)
    assert seen == [(s, f"step-{s}", True) for s in (2, 4)]
