"""torchrun worker for tests/dist/test_collectives.py: every rank now reads the manifest itself, so a manifest
damaged for everyone must read as a corrupt checkpoint (fall back), never as "the root is not shared".
With ``data``, step 2's data file that only rank 1 verifies is damaged instead: corruption one rank found,
never "ranks see different checkpoints".

    torchrun --standalone --nproc-per-node=2 corrupt_manifest_worker.py ROOT OUT [manifest|data]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import safepoint
from tests.helpers.procs.exiting import run_then_exit


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    what = sys.argv[3] if len(sys.argv) > 3 else "manifest"
    safepoint.init_process_group("gloo")
    model = torch.nn.Linear(4, 4)
    state = safepoint.TrainState(model=model)
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        if dist.get_rank() == 0 and what == "manifest":
            (root / "step-2" / "safepoint.json").write_text("{not json")
        elif dist.get_rank() == 0:
            files = sorted(json.loads((root / "step-2" / "safepoint.json").read_text())["files"])
            path = root / "step-2" / files[1::2][0]  # the first file rank 1 verifies, rank 0 does not
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x01
            path.write_bytes(bytes(data))
        dist.barrier()
        step = mgr.restore(state)
    (out / f"rank{dist.get_rank()}").write_text(str(step))
    dist.destroy_process_group()


if __name__ == "__main__":
    run_then_exit(main)  # never through the teardown: tests/helpers/procs/exiting.py
