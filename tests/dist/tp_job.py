"""A tensor-parallel training job saved through safepoint's public API (tests/dist/test_tensor_parallel.py).

    torchrun --nproc-per-node 2 tp_job.py --root DIR --steps N --save-every K [--step-sleep S] [--out F]
    torchrun --nproc-per-node 4 tp_job.py --dp 2 ...                  # a 2-D mesh: FSDP2 over "dp", TP over "tp"
    python tp_job.py --root DIR --steps N --save-every K --out F        # one rank: a plain model

With several ranks the MLP's ``up`` layer is sharded with ``ColwiseParallel`` and its ``down`` layer with
``RowwiseParallel`` over a 1-D ``DeviceMesh`` (``torch.distributed.tensor.parallel``: DTensor parameters and
optimizer state, each rank holding its shard); the ``head`` stays a plain, replicated layer. On one rank the
same model is left plain: restoring a tensor-parallel checkpoint there is DCP's reshard. Every rank of a
tensor-parallel group sees the same batches (tensor parallelism splits the layers, not the data).
``--dp D`` (D > 1): torchtitan's layout, a ``(D, world / D)`` mesh named ``("dp", "tp")``: the same plan over
"tp", then ``fully_shard`` (FSDP2) over "dp" on each of ``up`` and ``down`` and on the root, so the
parameters are 2-D DTensors; each "dp" rank trains on its slice of the batch. ``--hidden H``: the width that
tensor parallelism splits (a degree that does not divide it shards unevenly). Each rank prints ``rank R step
N loss L`` and writes its pid to ``<root>.pid-R`` (torchrun starts its workers in sessions of their own: a
test kills them by pid). ``--out``: rank 0 writes the full (gathered) weights and optimizer state at the end.
``--expect F``: right after the first restore, every rank gathers the full state and compares it with the
file F (another run's ``--out``) bit for bit: ``rank R restored S bitwise``, exit 3 if it differs.
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
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import safepoint
from tests.helpers.procs.exiting import run_then_exit


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(16, hidden)
        self.down = nn.Linear(hidden, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.down(torch.relu(self.up(x)))))


def build(seed: int, world: int, hidden: int = 64, dp: int = 1) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = MLP(hidden)
    if world > 1:
        # An uneven split (a degree that does not divide ``hidden``) keeps ``up``'s output a DTensor: torch's
        # default hands ``down`` the local shard, and RowwiseParallel rebuilds it with ``from_local``, which
        # assumes even shards (the forward then fails: "a and b must have same reduction dim").
        even = hidden % (world // dp) == 0
        plan = {"up": ColwiseParallel(use_local_output=even), "down": RowwiseParallel()}
        if dp == 1:
            parallelize_module(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), plan)
        else:  # as torchtitan: tensor parallelism over "tp" first, then FSDP2 over "dp" per block and the root
            mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
            parallelize_module(model, mesh["tp"], plan)
            for layer in (model.up, model.down):
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
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


def batch(step: int, dp_rank: int = 0, dp: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's batch, or a data-parallel rank's slice of it."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 16, generator=g)[dp_rank::dp]
    return x, x.sum(dim=1, keepdim=True)


def same_as(got: dict[str, Any], path: str) -> bool:
    want = torch.load(path, weights_only=True)
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--out")
    p.add_argument("--expect")
    p.add_argument("--check-restore", action="store_true")
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        safepoint.init_process_group("gloo", timeout_s=60)
    rank = dist.get_rank() if world > 1 else 0
    with open(f"{args.root}.pid-{rank}", "w") as f:
        f.write(str(os.getpid()))
    dp = args.dp if world > 1 else 1
    model, opt = build(0, world, args.hidden, dp)
    state = safepoint.TrainState(model=model, optimizer=opt)
    with safepoint.CheckpointManager(args.root, save_every_steps=args.save_every, async_save=True) as mgr:
        step = mgr.restore(state)
        if args.expect:
            same = same_as(full_state(model, opt), args.expect)
            sys.stdout.write(f"rank {rank} restored {step} {'bitwise' if same else 'DIFFERENT'}\n")
            sys.stdout.flush()
            if not same:
                raise SystemExit(3)
        while step < args.steps:
            step += 1
            x, y = batch(step, rank // (world // dp), dp)
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
        fresh, fresh_opt = build(1, world, args.hidden, dp)  # other weights, an empty optimizer state
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
