"""Restore time of an incremental checkpoint against a full one (issue 26), interleaved: two roots written
from the same LoRA-shaped training (bench_incremental.py's ``lora``: 128 MiB frozen, 1 MiB adapters + AdamW,
five saves, ``keep_last=3``), one with full saves and one incremental (``full_every=0``, so its newest step
links the frozen base from an older one); then the newest step of each is restored in turn, ``--rounds``
times, and the medians compared. One restore per variant (what bench_incremental.py reports) swings by tens
of percent on a loaded machine; this is the measurement to quote.

    PYTHONPATH=src python benchmarks/bench_incremental_restore.py --dir /dev/shm --rounds 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import safepoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_incremental import MODELS


def _write(base: str, incremental: bool) -> str:
    torch.manual_seed(0)
    model = MODELS["lora"]()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    root = os.path.join(tempfile.mkdtemp(dir=base), "root")
    writer = safepoint.WriterOptions(incremental=incremental, full_every=0)
    with safepoint.CheckpointManager(root, keep=safepoint.Keep(last=3), writer=writer) as mgr:
        for step in range(1, 6):
            model.loss().backward()
            opt.step()
            opt.zero_grad()
            mgr.save(step, safepoint.TrainState(model=model, optimizer=opt))
    return root


def _restore(root: str) -> float:
    fresh = MODELS["lora"]()
    opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-3)
    t0 = time.perf_counter()
    with safepoint.CheckpointManager(root) as mgr:
        mgr.restore(safepoint.TrainState(model=fresh, optimizer=opt))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    roots = {"full": _write(args.dir, False), "incremental": _write(args.dir, True)}
    times: dict[str, list[float]] = {k: [] for k in roots}
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for name, root in roots.items():
            times[name].append(_restore(root))
    load.append(os.getloadavg()[0])
    full, inc = statistics.median(times["full"]), statistics.median(times["incremental"])
    print(f"restore of the newest step, median of {args.rounds} (load avg {min(load):.1f}-{max(load):.1f}):")
    print(f"  full {full * 1000:.0f} ms, incremental {inc * 1000:.0f} ms = {inc / full:.2f}x")
    for name, root in roots.items():
        print(f"  {name}: {sorted(os.listdir(Path(root) / 'step-5'))}")


if __name__ == "__main__":
    main()
