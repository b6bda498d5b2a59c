"""A training job for the goodput report's test: saves every ``every`` steps, and measures each save from
the outside (the time around each ``maybe_save`` call that saved), printing what it measured.

``python -m tests.helpers.procs.goodput_worker ROOT TOTAL EVERY [HANG_AT]``; with ``GOODPUT_S3_ENDPOINT``
set, ROOT is an ``s3://`` URL on that endpoint and the run journal is copied there every 0.1 s: prints ``RESTORED n``, one
``SAVE step seconds`` per save, and with HANG_AT prints ``REACHED step`` once that step's ``maybe_save``
returned and then waits to be killed (the parent sends SIGKILL: no close(), no atexit).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

import safepoint


def main() -> None:
    root, total, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    hang_at = int(sys.argv[4]) if len(sys.argv) > 4 else None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = safepoint.TrainState(model=model, optimizer=opt)
    options: dict[str, Any] = {}
    if endpoint := os.environ.get("GOODPUT_S3_ENDPOINT"):
        from safepoint.tiers import journal_mirror
        from tests.helpers.s3 import storage_options

        journal_mirror.DEFAULT_INTERVAL_S = 0.1  # the test's copies, not a job's (30 s)
        options["storage_options"] = storage_options(endpoint)
    keep = safepoint.Keep(last=2)
    with safepoint.CheckpointManager(root, save_every_steps=every, keep=keep, **options) as mgr:
        restored = mgr.restore(state)
        print(f"RESTORED {restored}", flush=True)
        for step in range(restored + 1, total + 1):
            loss = model(torch.randn(8, 64)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(0.01)  # a step that takes time: the report's redone seconds are not all noise
            t0 = time.perf_counter()
            saved = mgr.maybe_save(step, state)
            took = time.perf_counter() - t0
            if saved:
                print(f"SAVE {step} {took:.6f}", flush=True)
            if step == hang_at:
                print(f"REACHED {step}", flush=True)
                time.sleep(600)


if __name__ == "__main__":
    main()
