"""``safepoint report ROOT [--json] [--plot FILE.png]``: what checkpointing and failures cost a run.

Reads ROOT's attempts file (``.attempts.json``), run journal (``.journal.jsonl``) and progress file
(``.progress``), each as hostile input (regular files only, bounded, every record validated; a bad line is
skipped and counted). Read-only: it takes no lease and writes nothing under ROOT. The numbers are explained
in cli/goodput.py and docs/goodput.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from safepoint.cli.common import EXIT_OK, UsageError, add_flag, add_root, command, when
from safepoint.cli.goodput import RunReport, analyze
from safepoint.errors import CheckpointError
from safepoint.policy.history import RunHistory
from safepoint.policy.journal import read_journal, read_progress
from safepoint.remote.object_layout import is_url
from safepoint.store.posix_layout import Layout


def build_report(root: str | os.PathLike[str]) -> RunReport:
    """The report of the run in the local ``root`` (CheckpointError if it is not a readable directory)."""
    where = os.fspath(root)
    if is_url(where) and not where.startswith("file://"):
        raise CheckpointError(
            f"{where}: the run journal is kept on the local disk of the job (ROOT, or local_root with a URL "
            "root): run `safepoint report LOCAL_ROOT`"
        )
    path = Path(where.removeprefix("file://"))
    if not path.is_dir() or path.is_symlink():
        raise CheckpointError(f"{path} is not a checkpoint root (no such directory)")
    # history.py reads the attempts file as it does at a manager's start (validated; unreadable: none).
    history = logging.getLogger("safepoint")
    level = history.level
    history.setLevel(logging.ERROR)  # its "starts over" warning is about a manager's start, not a report
    try:
        attempts = RunHistory(Layout(path))._load()
    finally:
        history.setLevel(level)
    try:
        records, skipped = read_journal(path)
    except OSError as e:
        raise CheckpointError(f"cannot read the run journal of {path}: {e}") from None
    return analyze(str(path), attempts, records, skipped, read_progress(path))


def _seconds(s: float) -> str:
    if s < 120:
        return f"{s:.2f}s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"


def render(report: RunReport, out: Console) -> None:
    """The report as text (what `safepoint report` and `make demo` print)."""
    r = report
    if not r.attempts:
        out.print(f"no run recorded in {escape(r.root)} (no attempts file or journal: a root written before")
        out.print("safepoint 0.x recorded runs, or by a manager that did not own it)")
        return
    first, last = r.attempts[0].start, max(a.end for a in r.attempts)
    lines = [
        ("run", f"{when(first)} -> {when(last)}  ({_seconds(r.wall_s)} wall, {_seconds(r.run_s)} running)"),
        ("attempts", f"{len(r.attempts)} ({r.restarts} restart(s))"),
        ("saves", f"{r.saves} committed, {r.failed_saves} failed, {r.emergency_saves} emergency"),
        ("loop blocked by saves", f"{_seconds(r.blocking_s)} ({r.overhead_pct:.2f}% of the running time)"),
        ("restores", _seconds(r.restore_s)),
        (
            "lost to restarts",
            f"{_seconds(r.restart_lost_s)}: {_seconds(r.downtime_s)} down, {_seconds(r.redone_s)} redoing "
            f"{r.steps_redone} step(s)",
        ),
        ("steps redone", str(r.steps_redone)),
        ("durability lag", _lag(r)),
        ("goodput", f"{100 * r.goodput:.1f}% of the wall time"),
    ]
    out.print(f"[bold]safepoint report[/] {escape(r.root)}")
    for name, value in lines:
        out.print(f"  {name:<22} {value}")
    out.print("  attempts:")
    for i, a in enumerate(r.attempts):
        restored = "fresh start" if not a.restored else f"restored step {a.restored}"
        redo = f", {a.steps_redone} step(s) redone" if a.steps_redone else ""
        reached = "-" if a.last_step is None else str(a.last_step)
        took = _seconds(a.end - a.start)
        out.print(
            f"    {i + 1}. {when(a.start)}  {took:>9}  {restored}, reached step {reached}, "
            f"{a.saves} save(s){redo}; {a.outcome}"
        )
    if r.skipped_lines:
        out.print(f"  [yellow]{r.skipped_lines} malformed journal line(s) skipped[/]")


def _lag(r: RunReport) -> str:
    if r.durable_lag_max_s is None:
        return "no durable copy recorded"
    text = f"max {_seconds(r.durable_lag_max_s)}, mean {_seconds(r.durable_lag_mean_s or 0.0)}"
    if r.last_step is not None and r.last_durable_step is not None:
        text += f"; at the end {max(0, r.last_step - r.last_durable_step)} step(s) not durable"
    return text


def cmd_report(args: argparse.Namespace, out: Console, err: Console) -> int:
    report = build_report(args.root)
    if args.plot is not None:
        if not args.plot.parent.is_dir():
            raise UsageError(f"--plot: no directory {args.plot.parent}")
        from safepoint.cli.report_plot import plot  # matplotlib: imported only when asked for

        plot(report, args.plot)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        render(report, out)
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
