"""Restore time of an incremental checkpoint against a full one (issue 26), interleaved: two roots written
from the same LoRA-shaped training (bench_incremental.py's ``lora``: 128 MiB frozen, 1 MiB adapters + AdamW,
five saves, ``keep_last=3``), one with full saves and one incremental (``full_every=0``, so its newest step
links the frozen base from an older one); then the newest step of each is restored in turn, ``--rounds``
times, and the medians compared. One restore per variant (what bench_incremental.py reports) swings by tens
of percent on a loaded machine; this is the measurement to quote.

    PYTHONPATH=src python benchmarks/bench_incremental_restore.py --dir /dev/shm --rounds 6
    PYTHONPATH=src python benchmarks/bench_incremental_restore.py --dir /var/tmp --rounds 12 [--cold]

``--cold`` evicts the newest step's files from the page cache before each restore (posix_fadvise
DONTNEED), so they are read from the disk, as after a reboot.
"""

from __future__ import annotations

import argparse
import os
import shutil
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


def _drop_cache(root: str) -> None:
    """Evict the newest step's files from the page cache (clean pages: they were fsync'd at the save), so
    the restore reads them from the disk as after a reboot, without touching any other file's cache."""
    step = max(Path(root).glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    for path in step.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _restore(root: str, *, cold: bool = False) -> float:
    if cold:
        _drop_cache(root)
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
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--cold", action="store_true", help="read the files from the disk (page cache dropped)")
    args = ap.parse_args()
    if args.threads:
        # On a loaded 2-core machine torch's intra-op threads (the optimizer's state init in restore)
        # contend with everything else: most of the run-to-run spread. One thread isolates the I/O.
        torch.set_num_threads(args.threads)
    roots = {"full": _write(args.dir, False), "incremental": _write(args.dir, True)}
    times: dict[str, list[float]] = {k: [] for k in roots}
    load = [os.getloadavg()[0]]
    for i in range(args.rounds):
        # ABBA order: neither variant always goes first (the first restore of a round warms what both
        # share: the allocator, imports, the page cache of the directory walk).
        for name in list(roots) if i % 2 == 0 else list(roots)[::-1]:
            times[name].append(_restore(roots[name], cold=args.cold))
    load.append(os.getloadavg()[0])
    full, inc = statistics.median(times["full"]), statistics.median(times["incremental"])
    what = "cold page cache" if args.cold else "warm page cache"
    loads = f"load avg {min(load):.1f}-{max(load):.1f}"
    print(f"restore of the newest step, {what}, median of {args.rounds} ({loads}):")
    print(f"  full {full * 1000:.0f} ms, incremental {inc * 1000:.0f} ms = {inc / full:.2f}x")
    for name, root in roots.items():
        print(f"  {name}: {sorted(os.listdir(Path(root) / 'step-5'))}")
        shutil.rmtree(Path(root).parent)  # the temporary directory _write made


if __name__ == "__main__":
    main()
