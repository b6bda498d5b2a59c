"""A training process with a tiered manager (local disk + S3); the parent SIGKILLs it mid-upload.

argv: local_root url endpoint steps. Prints "COMMITTED <step>" once each save is committed locally, then
waits for its uploads (which the parent's proxy may be holding) and prints "DONE".
"""

from __future__ import annotations

import json
import sys

import torch

import safepoint


def main() -> None:
    local_root, url, endpoint, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    opts = {
        "client_kwargs": {"endpoint_url": endpoint},
        "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}},
    }
    model = torch.nn.Linear(64, 64)
    state = safepoint.TrainState(model=model, extra={"step": 0})
    with safepoint.CheckpointManager(url, local_root=local_root, storage_options=opts) as mgr:
        for step in range(1, steps + 1):
            with torch.no_grad():
                model.weight.fill_(step)
            mgr.save(step, state)
            print(f"COMMITTED {step}", flush=True)
        mgr.wait()
        print("DONE " + json.dumps(mgr.durability_lag().durable_step), flush=True)


if __name__ == "__main__":
    main()
