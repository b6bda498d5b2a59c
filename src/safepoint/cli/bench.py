"""``safepoint bench``: run the benchmark suite from a source checkout and print its ratio tables.

The benchmarks live in ``benchmarks/`` (they compare safepoint with plain DCP, ``torch.save``, ``dd`` and
boto3, so they are not part of the installed package). Results and the commands behind the published
numbers are in docs/benchmarks.md (the runs behind them: benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

SUITES = {
    "save": ("bench_save.py", ["--size-mib", "256", "--rounds", "3"]),
    # The training part's defaults (K = 50, 8 rounds, 2 thread counts) take half an hour: fewer here.
    "async": (
        "bench_async.py",
        [
            "--size-mib",
            "256",
            "--rounds",
            "3",
            "--every",
            "20",
            "--train-rounds",
            "2",
            "--train-threads",
            "2",
        ],
    ),
    "upload": ("bench_upload.py", ["--size-mib", "256", "--rounds", "2"]),
}


def _bench_dir() -> Path | None:
    # src/safepoint/bench.py -> <checkout>/benchmarks
    here = Path(__file__).resolve().parents[3] / "benchmarks"  # src/safepoint/cli/ -> the checkout
    return here if here.is_dir() else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="safepoint bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  safepoint bench                 # quick run of every suite (256 MiB)\n"
        "  safepoint bench save -- --size-mib 2048 --rounds 10   # the published save/restore run",
    )
    p.add_argument(
        "suites",
        nargs="*",
        metavar="SUITE",
        help=f"which suites ({', '.join(SUITES)}); default all",
    )
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: arguments passed to the suite script")
    a = p.parse_args(argv)
    unknown = [s for s in a.suites if s not in SUITES]
    if unknown:
        p.error(f"unknown suite {unknown[0]!r} (choose from {', '.join(SUITES)})")
    bench_dir = _bench_dir()
    if bench_dir is None:
        print(
            "safepoint: error: `safepoint bench` needs a source checkout (benchmarks/ not found)",
            file=sys.stderr,
        )
        return 2
    extra = [x for x in a.extra if x != "--"]
    rc = 0
    for name in a.suites or list(SUITES):
        script, quick = SUITES[name]
        cmd = [sys.executable, str(bench_dir / script), *(extra or quick)]
        print(f"$ {' '.join(cmd[1:])}", flush=True)
        rc = rc or subprocess.run(cmd, check=False).returncode
    return rc


if __name__ == "__main__":
    sys.exit(main())
