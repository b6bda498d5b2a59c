"""``safepoint ls``, ``verify`` and ``prune``: what is in a root, can it be trusted, free space."""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import Any

from rich.console import Console
from rich.filesize import decimal
from rich.markup import escape
from rich.table import Table

from safepoint.cli import tools
from safepoint.cli.common import (
    EXIT_OK,
    EXIT_PROBLEMS,
    UsageError,
    add_flag,
    add_root,
    add_step,
    at_least,
    command,
    metrics_text,
    progress,
    when,
)
from safepoint.errors import CheckpointError, CorruptCheckpointError
from safepoint.policy.keep import Keep
from safepoint.policy.rules import KeepBest
from safepoint.remote.object_layout import RemoteLayout
from safepoint.store.posix_layout import Layout
from safepoint.store.shared_files import steps_sharing

_STATUS_STYLE = {tools.OK: "green", tools.CORRUPT: "bold red", tools.PARTIAL: "yellow", tools.IGNORED: "red"}


def cmd_ls(args: argparse.Namespace, out: Console, err: Console) -> int:
    layout = tools.open_any_root(args.root)
    entries = tools.scan(layout, verify=args.verify)
    if args.json:
        print(json.dumps([e.to_json() for e in entries], indent=2))
        return EXIT_OK
    if not entries:
        out.print(f"no checkpoints in {escape(str(layout.root))}")
        _pending_notes(layout, out)  # a hostile .pending matters most when nothing else is there
        return EXIT_OK
    table = Table(title=escape(str(layout.root)), title_justify="left")
    problems = any(e.reason for e in entries)
    for col in ("step", "time", "size", "status", "tier", "metrics", *(["problem"] if problems else [])):
        table.add_column(col, justify="right" if col in ("step", "size") else "left")
    for e in entries:
        status = f"[{_STATUS_STYLE[e.status]}]{e.status}[/]"
        row = [str(e.step), when(e.time), decimal(e.bytes), status, e.tier, metrics_text(e.metrics)]
        table.add_row(*row, *([escape(e.reason or "")] if problems else []))
    out.print(table)
    _pending_notes(layout, out)
    return EXIT_OK


def _pending_notes(layout: Layout | RemoteLayout, out: Console) -> None:
    if odd := tools.pending_problem(layout):
        out.print(f"[red]warning[/]: {escape(odd)}")
    pending = tools.pending_saves(layout)
    if pending:
        out.print(
            f"[dim]{len(pending)} entr{'y' if len(pending) == 1 else 'ies'} under .pending/ (saves in "
            "progress or abandoned; never listed or loaded)[/]"
        )


def cmd_verify(args: argparse.Namespace, out: Console, err: Console) -> int:
    layout = tools.open_any_root(args.root)
    if args.all:
        steps = layout.committed_steps()
        if not steps:
            raise CheckpointError(f"no committed checkpoint in {layout.root}")
    else:
        steps = [tools.resolve_step(layout, args.step)]
    bad = 0
    for s in steps:
        total = 0
        with contextlib.suppress(CorruptCheckpointError):  # reported by verify_step below
            total = layout.read_manifest(s).total_bytes
        # One bar per checkpoint, closed before its verdict prints, so bar and lines never interleave.
        with progress(err, f"verifying step {s}", total) as advance:
            manifest, problems = tools.verify_step(layout, s, lambda _name, size: advance(size))
        held = None if manifest is None else tools.node_copy_of(layout, manifest, problems)
        if held is not None and manifest is not None:
            here = len(manifest.files) - len(problems)
            out.print(
                f"[green]ok[/]      step {s}: node-local copy of {escape(', '.join(held))}: {here} of "
                f"{len(manifest.files)} files here, intact; the other {len(problems)} are other nodes' "
                "share (verify the durable root for the whole checkpoint)"
            )
        elif problems or manifest is None:
            bad += 1
            for p in problems:
                out.print(f"[bold red]CORRUPT[/] {escape(str(p))}")
                if isinstance(layout, Layout) and p.file and (shared := steps_sharing(layout, s, p.file)):
                    # Incremental saves hard-link unchanged files: the same bytes are those steps' too.
                    names = ", ".join(f"step {x}" for x in shared)
                    out.print(
                        f"        {escape(p.file)} is the same file (a hard link) in {names}: also damaged"
                    )
        else:
            size = decimal(manifest.total_bytes)
            out.print(f"[green]ok[/]      step {s}: {len(manifest.files)} files, {size}")
    if args.all:
        for step, path in tools.step_dirs(layout).items():
            if step not in steps:
                out.print(
                    f"[yellow]note[/]    step {step}: {escape(str(path))} has no manifest (a partial save; "
                    "not a checkpoint, never loaded)"
                )
    out.print(f"{len(steps)} checked: {len(steps) - bad} intact, {bad} corrupt")
    return EXIT_PROBLEMS if bad else EXIT_OK


def cmd_prune(args: argparse.Namespace, out: Console, err: Console) -> int:
    if args.keep_last is None and args.keep_every is None and args.keep_best is None:
        raise UsageError("say what to keep: --keep-last N, --keep-every N and/or --keep-best N --metric NAME")
    if (args.keep_best is None) != (not args.metric):
        raise UsageError("--keep-best N and --metric NAME go together (keep the N best by that metric)")
    try:
        best = KeepBest(args.keep_best, args.metric, args.mode) if args.keep_best is not None else None
        retention = Keep(last=args.keep_last, every_steps=args.keep_every, best=best).retention()
    except ValueError as e:
        raise UsageError(str(e)) from None
    layout = tools.open_root(args.root)
    kept, deleted, corrupt = tools.prune(layout, retention, dry_run=args.dry_run, force=args.force)
    verb = "would delete" if args.dry_run else "deleted"
    for s in deleted:
        out.print(f"{verb} step {s}")
    out.print(f"kept {len(kept)}: {kept}; {verb} {len(deleted)}")
    if corrupt:
        out.print(
            f"[yellow]note[/]: failed verification, not counted as the newest and left alone: "
            f"{', '.join(f'step {s}' for s in corrupt)} (see `safepoint verify`)"
        )
    left = [e for e in tools.scan(layout) if e.status != tools.OK]
    if left:
        out.print(
            f"[yellow]note[/]: left alone (not committed or unreadable): "
            f"{', '.join(f'step {e.step} ({e.status})' for e in left)}"
        )
    return EXIT_OK


# ---- arguments -----------------------------------------------------------------------------------------


def add_ls(subs: Any) -> None:
    p = command(
        subs,
        "ls",
        cmd_ls,
        "list the checkpoints in ROOT (step, time, size, status, tier, metrics)",
        "  safepoint ls runs/ckpt\n  safepoint ls runs/ckpt --json | jq '.[] | select(.status != \"ok\")'\n"
        "\nstatus: ok = committed (manifest parses and self-verifies); corrupt = the manifest (or, with\n"
        "--verify, a file) is damaged; partial = a step directory without a manifest (never committed).\n"
        "--json paths are absolute (URLs for object-store roots).",
    )
    add_root(p)
    add_flag(p, "--json", "print a JSON list instead of a table")
    add_flag(p, "--verify", "also check every file's size and crc32c (reads all)")


def add_verify(subs: Any) -> None:
    p = command(
        subs,
        "verify",
        cmd_verify,
        "check size and crc32c of every file of a checkpoint against its manifest",
        "  safepoint verify runs/ckpt            # the newest checkpoint\n"
        "  safepoint verify runs/ckpt --step 1000\n  safepoint verify runs/ckpt --all && echo intact\n"
        "\nexit 0 only if every checked checkpoint is intact; one line per problem (step, file, reason).",
    )
    add_root(p)
    which = p.add_mutually_exclusive_group()
    add_step(which)
    add_flag(which, "--all", "verify every committed checkpoint")


def add_prune(subs: Any) -> None:
    p = command(
        subs,
        "prune",
        cmd_prune,
        "delete old checkpoints with the manager's retention policies",
        "  safepoint prune runs/ckpt --keep-last 3 --dry-run\n  safepoint prune runs/ckpt --keep-last 2\n"
        "  safepoint prune runs/ckpt --keep-last 1 --keep-best 2 --metric loss\n\n"
        "The newest checkpoint is never deleted. Refuses while a live writer holds ROOT's lease (judged by\n"
        "its heartbeat, or its pid where this process shares its boot and PID namespace); --force takes the\n"
        "lease over instead: that writer can then no longer commit or delete, and its next save fails.",
    )
    add_root(p)
    count = at_least(1)
    p.add_argument("--keep-last", type=count, metavar="N", help="keep the N newest")
    p.add_argument("--keep-every", type=count, metavar="N", help="keep steps that are multiples of N")
    p.add_argument("--keep-best", type=count, metavar="N", help="keep the N best by --metric")
    p.add_argument("--metric", help="metric name for --keep-best")
    p.add_argument("--mode", choices=("min", "max"), default="min", help="best = min (default) or max")
    add_flag(p, "--dry-run", "show what would be deleted; delete nothing")
    add_flag(p, "--force", "take the lease over from a live writer (fencing it) instead of refusing")
