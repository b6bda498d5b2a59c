"""Per-step cost of agreeing on time-based saves (docs/elastic.md quotes its output).

    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/dist/bench_agreement.py [WIDTH]

1. Latency of one exchange, back to back: an Agreement check (one all_reduce of two int64 on safepoint's
   gloo group) and the previous design's per-call ``broadcast_object_list`` of rank 0's decision.
2. A real DDP loop (ranks synchronised by the gradient all-reduce, as in training) timing only the
   ``maybe_save`` call, for a step policy (no communication), the time policy with Agreement, and the
   per-call broadcast. Nothing is ever due, so no save runs. Time spent waiting for a slower rank inside
   a check is not lost: that rank would otherwise be waited for in the next gradient all-reduce.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import safepoint

CALLS = 300


def measure(
    model: nn.Module, opt: torch.optim.Optimizer, call: Callable[[int], object]
) -> tuple[float, float]:
    """(mean us per maybe_save call, mean ms per training step)."""
    calls, steps = [], []
    x = torch.randn(32, model.module.in_features)  # type: ignore[union-attr,arg-type]
    for step in range(1, CALLS + 1):
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        t1 = time.perf_counter()
        call(step)
        calls.append(time.perf_counter() - t1)
        steps.append(t1 - t0)
    return statistics.mean(calls) * 1e6, statistics.mean(steps) * 1e3


def latency_us(fn: Callable[[], object], n: int = 500) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    width = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    safepoint.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.parallel.DistributedDataParallel(nn.Linear(width, width))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    state = safepoint.TrainState(model=model)
    box = [tempfile.mkdtemp() if rank == 0 else ""]
    dist.broadcast_object_list(box)
    with safepoint.CheckpointManager(f"{box[0]}/lat", save_every_seconds=3600) as mgr:
        comm, agreement = mgr.comm, mgr._agreement
        agreement.target_s = 0.0  # every call is a check
        steps = itertools.count(1)
        check_us = latency_us(lambda: agreement.agree(next(steps), False))
        assert agreement.checks >= 500
        bcast_us = latency_us(lambda: comm.broadcast(False))
    rows: list[tuple[str, float, float, int]] = []
    for name, kw, before in [
        ("step policy (no communication)", {"save_every_steps": 10**9}, False),
        ("time policy with Agreement", {"save_every_seconds": 3600}, False),
        ("time policy, broadcast every call (before)", {"save_every_seconds": 3600}, True),
    ]:
        with safepoint.CheckpointManager(f"{box[0]}/{len(rows)}", **kw) as mgr:  # type: ignore[arg-type]
            call = (
                (lambda s, m=mgr: m.comm.broadcast(False))
                if before
                else (lambda s, m=mgr: m.maybe_save(s, state))
            )
            us, step_ms = measure(model, opt, call)
            rows.append((name, us, step_ms, mgr._agreement.checks))
    if rank == 0:
        print(f"one Agreement check: {check_us:.0f} us; one broadcast of the decision: {bcast_us:.0f} us")
        print(f"{dist.get_world_size()} ranks, gloo, DDP Linear({width}, {width}), {CALLS} steps")
        for name, us, step_ms, checks in rows:
            print(f"  {name:44s} {us:8.1f} us/step  (step {step_ms:.2f} ms, {checks} agreement checks)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
