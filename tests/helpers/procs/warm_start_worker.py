"""torchrun worker for tests/dist/test_collectives.py: ``init_from`` a node-local path that exists for rank 0
only (each rank is given its own path to stand for one node-local path) must fail the same way on every
rank, never leave rank 0 waiting in a collective that rank 1 skipped.

    torchrun --standalone --nproc-per-node=2 warm_start_worker.py BASE OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

import safepoint
from tests.helpers.procs.exiting import run_then_exit


def main() -> None:
    base, out = Path(sys.argv[1]), Path(sys.argv[2])
    safepoint.init_process_group("gloo")
    rank = dist.get_rank()
    state = safepoint.TrainState(model=torch.nn.Linear(4, 4), rng=False)
    cluster = safepoint.ClusterOptions(collective_timeout_s=30)
    with safepoint.CheckpointManager(base / "pretrain", cluster=cluster) as mgr:
        mgr.save(3, state)
    source = base / ("pretrain" if rank == 0 else "missing")
    try:
        with safepoint.CheckpointManager(base / "run", cluster=cluster, init_from=source) as mgr:
            outcome = f"restored {mgr.restore(state)}"
    except safepoint.CheckpointError as e:
        msg = str(e).replace(str(base / "pretrain"), "SOURCE").replace(str(base / "missing"), "SOURCE")
        outcome = f"{type(e).__name__}: {msg}"
    (out / f"rank{rank}").write_text(outcome)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_then_exit(main)  # never through the teardown: tests/helpers/procs/exiting.py
