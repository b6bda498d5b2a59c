#!/usr/bin/env python
"""Issue 28: what rank 0's progress record (``ROOT/.progress``, written by every ``maybe_save``) costs.

One manager, ``maybe_save`` on steps where no save is due, 20,000 calls per round; rounds alternate the
manager's journal (the progress record on) with an unopened one (off), interleaved A/B, medians of 10 rounds.

    python benchmarks/bench_progress.py
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

import safepoint
from safepoint.policy.journal import Journal

CALLS, ROUNDS = 20_000, 10


def main() -> None:
    state = safepoint.TrainState(model=torch.nn.Linear(2, 2))
    with tempfile.TemporaryDirectory() as tmp:
        mgr = safepoint.CheckpointManager(os.path.join(tmp, "ckpt"), save_every_steps=10**9)
        on, off = mgr._journal, Journal(None)
        us: dict[str, list[float]] = {"on": [], "off": []}
        step = 0
        for r in range(ROUNDS):
            for name in ("on", "off") if r % 2 == 0 else ("off", "on"):
                mgr._journal = on if name == "on" else off
                t0 = time.perf_counter()
                for _ in range(CALLS):
                    step += 1
                    mgr.maybe_save(step, state)
                us[name].append((time.perf_counter() - t0) / CALLS * 1e6)
        mgr._journal = on
        mgr.close()
    a, b = statistics.median(us["on"]), statistics.median(us["off"])
    print(f"maybe_save, no save due: {a:.2f} us with the progress record, {b:.2f} us without "
          f"(ratio {a / b:.2f}); load average {os.getloadavg()[0]:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
