"""A tensor-parallel training job saved through safepoint's public API (tests/dist/test_tensor_parallel.py).

    torchrun --nproc-per-node 2 tp_job.py --root DIR --steps N --save-every K [--step-sleep S] [--out F]
    python tp_job.py --root DIR --steps N --save-every K --out F        # one rank: a plain model

With several ranks the MLP's ``up`` layer is sharded with ``ColwiseParallel`` and its ``down`` layer with
``RowwiseParallel`` over a 1-D ``DeviceMesh`` (``torch.distributed.tensor.parallel``: DTensor parameters and
optimizer state, each rank holding its shard); the ``head`` stays a plain, replicated layer. On one rank the
same model is left plain: restoring a two-rank checkpoint there is DCP's reshard. Every rank sees the same
batches (tensor parallelism splits the layers, not the data). Each rank prints ``rank R step N loss L`` and
writes its pid to ``<root>.pid-R`` (torchrun starts its workers in sessions of their own: a test kills them
by pid). ``--out``: rank 0 writes the full (gathered) weights and optimizer state at the end.
``--check-restore``: after the run, fresh parallelised objects restore the newest checkpoint through a new
manager and must equal the trained ones bit for bit (exit 3 otherwise).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import safepoint
from tests.helpers.procs.exiting import run_then_exit


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.down(torch.relu(self.up(x)))))


def build(seed: int, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = MLP()
    if world > 1:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    # foreach=False: one parameter at a time (DTensor and plain parameters side by side)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every weight and optimizer state tensor, gathered whole (``full_tensor``), by parameter name."""

    def whole(t: Any) -> Any:
        return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()

    out: dict[str, Any] = {}
    for name, param in model.named_parameters():
        out[name] = whole(param)
        for key, value in opt.state.get(param, {}).items():
            out[f"{name}.{key}"] = whole(value)
    return out


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--out")
    p.add_argument("--check-restore", action="store_true")
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        safepoint.init_process_group("gloo", timeout_s=60)
    rank = dist.get_rank() if world > 1 else 0
    with open(f"{args.root}.pid-{rank}", "w") as f:
        f.write(str(os.getpid()))
    model, opt = build(0, world)
    state = safepoint.TrainState(model=model, optimizer=opt)
    with safepoint.CheckpointManager(args.root, save_every_steps=args.save_every, async_save=True) as mgr:
        step = mgr.restore(state)
        while step < args.steps:
            step += 1
            x, y = batch(step)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            # One write per line: under PYTHONUNBUFFERED (set on CI) print() writes the text and its newline
            # separately, and the two ranks' lines, sharing one pipe, could interleave into unreadable ones.
            sys.stdout.write(f"rank {rank} step {step} loss {loss.item()!r}\n")
            sys.stdout.flush()
            mgr.maybe_save(step, state)
            time.sleep(args.step_sleep)
        if step > 0:
            mgr.save(step, state)  # the last step, whatever the interval (no-op if it was just saved)
    trained = full_state(model, opt)
    if args.out and rank == 0:
        torch.save(trained, args.out)
    if args.check_restore:
        fresh, fresh_opt = build(1, world)  # other weights, an empty optimizer state
        with safepoint.CheckpointManager(args.root) as mgr:
            restored = mgr.restore(safepoint.TrainState(model=fresh, optimizer=fresh_opt))
        got = full_state(fresh, fresh_opt)
        same = restored == step and got.keys() == trained.keys()
        same = same and all(torch.equal(got[k], trained[k]) for k in trained)
        sys.stdout.write(f"rank {rank} restored {restored} {'bitwise' if same else 'DIFFERENT'}\n")
        sys.stdout.flush()
        if not same:
            raise SystemExit(3)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_then_exit(main)
