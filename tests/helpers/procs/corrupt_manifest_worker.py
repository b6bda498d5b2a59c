"""torchrun worker for tests/dist/test_collectives.py: every rank now reads the manifest itself, so a manifest
damaged for everyone must read as a corrupt checkpoint (fall back), never as "the root is not shared".

    torchrun --standalone --nproc-per-node=2 corrupt_manifest_worker.py ROOT OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

import safepoint


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    safepoint.init_process_group("gloo")
    model = torch.nn.Linear(4, 4)
    state = safepoint.TrainState(model=model)
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        if dist.get_rank() == 0:
            (root / "step-2" / "safepoint.json").write_text("{not json")
        dist.barrier()
        step = mgr.restore(state)
    (out / f"rank{dist.get_rank()}").write_text(str(step))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
