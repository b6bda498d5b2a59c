#!/usr/bin/env python
"""Issue 27, round 14: the commit protocol's operations of one steady save, timed alone (thread CPU).

Inside a real save these few-hundred-microsecond operations are lost in the noise of a loaded 2-core
machine; here each runs by itself, many times, on ``/dev/shm``, so two trees can be compared by running
this script with each on ``PYTHONPATH`` in turn (interleaved, as in docs/benchmarks.md round 14):

- ``remove``: ``Layout.remove`` of a step of six files (retention's delete of the previous step);
- ``commit``: ``Layout.commit`` of a pending directory of five files (manifest written, fsyncs, rename);
- ``save_dir``: ``make_save_dir`` of a new pending directory (DCP's mkdir of the save's directory);
- ``rng``: ``capture_rng`` (the RNG section of every capture).

Each figure is the median over ``--blocks`` blocks of the mean thread CPU per call in the block (no lease:
the fence, the same in both trees, is not timed).

    PYTHONPATH=src python benchmarks/bench_root_ops.py
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _common import load_1m

from safepoint.data.rng import capture_rng
from safepoint.store.manifest import FileEntry, Manifest
from safepoint.store.posix_layout import Layout
from safepoint.store.rootfs import RootDir
from safepoint.store.storage import _ChecksummingFileSystem

_FILES = (
    "safepoint.json",
    ".metadata",
    "rank-0.state",
    "rank-0.fingerprints",
    "__0_0.distcp",
    "__0_1.distcp",
)


def _blocks(
    blocks: int, per: int, prepare: Callable[[int], object], run: Callable[[object], object]
) -> float:
    """Median over ``blocks`` of the mean thread CPU (us) of ``run(prepare(i))``, ``prepare`` untimed."""
    out, n = [], 0
    for _ in range(blocks):
        spent = 0.0
        for _ in range(per):
            n += 1
            arg = prepare(n)
            t0 = time.thread_time()
            run(arg)
            spent += time.thread_time() - t0
        out.append(spent / per * 1e6)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=7)
    p.add_argument("--per", type=int, default=300)
    args = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-root-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        layout = Layout(base / "root")
        layout.ensure_root()
        fs = _ChecksummingFileSystem(None, RootDir(layout.root))  # type: ignore[arg-type]
        entries = {name: FileEntry(size=1, crc32c="00000000") for name in _FILES[1:]}

        def step(n: int) -> int:
            where = layout.step_path(n)
            where.mkdir()
            for name in _FILES:
                (where / name).write_bytes(b"x")
            return n

        def pending(n: int) -> tuple[Path, Manifest]:
            where = layout.new_pending(n, "bench")
            where.mkdir()
            return where, Manifest(step=n, files=entries)

        load = load_1m()
        got = {
            "remove": _blocks(args.blocks, args.per, step, lambda n: layout.remove(n)),  # type: ignore[arg-type]
            "commit": _blocks(args.blocks, args.per, pending, lambda pm: layout.commit(*pm)),  # type: ignore[misc]
            "save_dir": _blocks(
                args.blocks, args.per, lambda n: layout.new_pending(n, "dir"), fs.make_save_dir
            ),
            "rng": _blocks(args.blocks, args.per, lambda n: n, lambda _: capture_rng()),
        }
    finally:
        shutil.rmtree(base, ignore_errors=True)
    cells = "  ".join(f"{k} {v:.0f} us" for k, v in got.items())
    print(f"thread CPU per call: {cells}  load {load}->{load_1m()}", flush=True)


if __name__ == "__main__":
    main()
