"""``safepoint report ROOT [--json] [--plot FILE.png]``: what checkpointing and failures cost a run.

Reads ROOT's attempts file (``.attempts.json``), run journal (``.journal.jsonl``) and progress file
(``.progress``), each as hostile input (regular files only, bounded, every record validated; a bad line is
skipped and counted). For a URL root (``s3://...``) they are the objects ``ROOT/.run/`` that rank 0 of the job
copies there (tiers/journal_mirror.py), downloaded into a temporary directory (each refused above its size
cap) and read the same way; a path durable root of a tiered job holds that copy as ``ROOT/.run/`` files.
Read-only: it takes no lease and writes nothing under ROOT. The numbers are explained in policy/goodput.py
and docs/goodput.md.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from safepoint.cli.common import EXIT_OK, UsageError, add_flag, add_root, command
from safepoint.errors import CheckpointError
from safepoint.policy.goodput import RunReport, build_report, report_lines
from safepoint.remote.object_layout import RemoteLayout, is_url
from safepoint.store.rootfs import RootDir
from safepoint.tiers.journal_mirror import CAPS, RUN_PREFIX, fetch_run_files


def url_report(url: str) -> RunReport:
    """The report of a URL root, from its ``.run/`` objects (endpoint and credentials from the environment,
    as for ``ls``/``verify``)."""
    try:
        remote = RemoteLayout(url)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    with tempfile.TemporaryDirectory(prefix="safepoint-report-") as tmp:
        try:
            found = fetch_run_files(remote, Path(tmp))
        except OSError as e:
            raise CheckpointError(f"cannot read the run journal of {remote.root}: {e}") from None
        if not found:
            raise CheckpointError(
                f"{remote.root} has no run journal ({RUN_PREFIX}/): no job has saved there since safepoint "
                "began copying it"
            )
        report = build_report(tmp)
    report.root = remote.root
    return report


def local_report(where: str) -> RunReport:
    """The report of a local root: its own run files, or, where it has none, the copy in ``ROOT/.run/``
    (a path durable root of a tiered job: the files live in ``local_root``, and rank 0 copies them to the
    durable root's ``.run/`` as to a bucket's)."""
    path = Path(where.removeprefix("file://"))
    root = RootDir(path)
    if root.isdir("") and not any(root.lexists(name) for name in CAPS) and root.isdir(RUN_PREFIX):
        report = build_report(path / RUN_PREFIX)
        report.root = str(path)
        return report
    return build_report(where)


def cmd_report(args: argparse.Namespace, out: Console, err: Console) -> int:
    where = os.fspath(args.root)
    report = url_report(where) if is_url(where) and not where.startswith("file://") else local_report(where)
    if args.plot is not None:
        if not args.plot.parent.is_dir():
            raise UsageError(f"--plot: no directory {args.plot.parent}")
        from safepoint.cli.report_plot import plot  # matplotlib: imported only when asked for

        plot(report, args.plot)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        for line in report_lines(report):
            out.print(escape(line))
        if args.plot is not None:
            out.print(f"  timeline: {escape(os.fspath(args.plot))}")
    return EXIT_OK


def _plot_path(value: str) -> Path:
    path = Path(value)
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise argparse.ArgumentTypeError(f"--plot writes a .png, .svg or .pdf file, got {value!r}")
    return path


def add_report(subs: Any) -> None:
    p = command(
        subs,
        "report",
        cmd_report,
        "what checkpointing and failures cost the run in ROOT: saves, blocking, restarts, goodput",
        "  safepoint report runs/ckpt\n  safepoint report runs/ckpt --json | jq .goodput\n"
        "  safepoint report runs/ckpt --plot timeline.png\n"
        "\nFrom ROOT's attempts file and run journal (rank 0 of the job records them); see docs/goodput.md.",
    )
    add_root(p)
    add_flag(
        p, "--json", "print the numbers as JSON (saves, blocking_s, restarts, steps_redone, goodput, ...)"
    )
    p.add_argument("--plot", type=_plot_path, metavar="FILE.png", help="draw the run's timeline (matplotlib)")
