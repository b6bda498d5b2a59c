"""torchrun worker for tests/dist/test_collectives.py: a partial restore (strict=False) where only rank 1
reads a damaged ``.metadata`` (node-local copies of one checkpoint, rank 1's altered after saving) must end
the same way on every rank, as the default (strict) path does: never a rank stuck in a collective the other
skipped, never a traceback of our own.

    torchrun --standalone --nproc-per-node=2 partial_metadata_worker.py BASE OUT
"""

from __future__ import annotations

import shutil
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
    cluster = safepoint.ClusterOptions(collective_timeout_s=60)
    with safepoint.CheckpointManager(base / "shared", cluster=cluster) as mgr:
        mgr.save(1, state)
    if rank == 0:
        for r in (0, 1):
            shutil.copytree(base / "shared", base / f"r{r}", ignore=shutil.ignore_patterns(".lease"))
        metadata = base / "r1" / "step-1" / ".metadata"  # a file rank 1 does not verify up front
        data = bytearray(metadata.read_bytes())
        data[-3] ^= 0xFF
        metadata.write_bytes(bytes(data))
    dist.barrier()
    outcomes = []
    with safepoint.CheckpointManager(base / f"r{rank}", cluster=cluster) as mgr:
        for strict in (True, False):
            try:
                outcomes.append(f"restored {mgr.restore(state, strict=strict)}")
            except safepoint.CheckpointError as e:
                outcomes.append(f"{type(e).__name__}: {str(e).replace(str(base / f'r{rank}'), 'ROOT')}")
    (out / f"rank{rank}").write_text("\n".join(outcomes))
    dist.destroy_process_group()


if __name__ == "__main__":
    run_then_exit(main)  # never through the teardown: tests/helpers/procs/exiting.py
