"""``safepoint inspect`` and ``diff``: what is inside a checkpoint, and what changed between two."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from rich.console import Console
from rich.filesize import decimal
from rich.markup import escape
from rich.table import Table

from safepoint.cli import tools, tools_diff, tools_read
from safepoint.cli.common import (
    EXIT_OK,
    EXIT_PROBLEMS,
    add_flag,
    add_root,
    add_step,
    command,
    load,
    metrics_text,
    verified,
    when,
)


def cmd_inspect(args: argparse.Namespace, out: Console, err: Console) -> int:
    layout = tools.open_root(args.root)
    step = tools.resolve_step(layout, args.step)
    manifest = verified(layout, step, err) if args.verify else layout.read_manifest(step)
    metadata = tools_read.read_verified_metadata(layout, step, manifest)
    keys = tools_read.describe_keys(metadata) + tools_read.describe_rank_files(layout, manifest)
    if args.json:
        doc = {
            "step": manifest.step,
            # Absolute, as in `ls --json`: scripts may run from another directory.
            "path": os.path.abspath(layout.step_path(step)),
            "time": manifest.time,
            "world_size": manifest.world_size,
            "host": manifest.host,
            "save_id": manifest.save_id,
            "sections": manifest.keys,
            "versions": manifest.versions,
            "metrics": manifest.metrics,
            "files": {k: {"size": v.size, "crc32c": v.crc32c} for k, v in sorted(manifest.files.items())},
            "keys": [
                {
                    "key": k.key,
                    "section": k.section,
                    "kind": k.kind,
                    "shape": k.shape,
                    "dtype": k.dtype,
                    "bytes": k.bytes,
                }
                for k in keys
            ],
        }
        print(json.dumps(doc, indent=2))
        return EXIT_OK
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    rows = [
        ("step", str(manifest.step)),
        ("path", str(layout.step_path(step))),
        ("time", when(manifest.time)),
        ("world size", str(manifest.world_size)),
        ("host", manifest.host),
        ("save id", manifest.save_id),
        ("sections", ", ".join(manifest.keys)),
        ("versions", " ".join(f"{k}={v}" for k, v in sorted(manifest.versions.items()))),
        ("metrics", metrics_text(manifest.metrics) or "-"),
        (
            "checksums",
            "all files verified"
            if args.verify
            else ".metadata verified (data files not read; `safepoint verify` checks them)",
        ),
    ]
    for label, value in rows:
        head.add_row(label, escape(value))
    out.print(head)
    files = Table(title="files", title_justify="left")
    for col, just in (("file", "left"), ("size", "right"), ("crc32c", "left")):
        files.add_column(col, justify=just)  # type: ignore[arg-type]
    for name, entry in sorted(manifest.files.items()):
        files.add_row(escape(name), decimal(entry.size), entry.crc32c)
    out.print(files)
    for section in tools_read.sections_of(k.key for k in keys):
        mine = [k for k in keys if k.section == section]
        n_tensors = sum(k.kind == "tensor" for k in mine)
        title = (
            f"{section}: {n_tensors} tensors, {len(mine) - n_tensors} objects, "
            f"{decimal(sum(k.bytes for k in mine))}"
        )
        table = Table(title=escape(title), title_justify="left")
        for col, just in (("key", "left"), ("shape", "left"), ("dtype", "left"), ("size", "right")):
            table.add_column(col, justify=just, overflow="fold")  # type: ignore[arg-type]
        for k in mine:
            shape = "object" if k.shape is None else str(list(k.shape))
            table.add_row(escape(k.key[len(section) + 1 :]), shape, k.dtype or "-", decimal(k.bytes))
        out.print(table)
    return EXIT_OK


def cmd_diff(args: argparse.Namespace, out: Console, err: Console) -> int:
    side_a, side_b = tools_diff.resolve_sides(args.paths, args.step)
    a, b = side_a.label, side_b.label
    if len(args.paths) == 2:  # two roots or step paths: long names, said once, then A and B
        out.print(escape(f"A: {a}\nB: {b}"))
        a, b = "A", "B"
    include = tools_read.model_only if args.model_only else tools_read.everything
    rows = tools_diff.diff_states(
        load(side_a.layout, side_a.step, err, include), load(side_b.layout, side_b.step, err, include)
    )
    table = Table(title=escape(f"{a} vs {b}"), title_justify="left")
    table.add_column("key", overflow="fold")
    table.add_column("max abs diff", justify="right")
    table.add_column("note")
    notes = {"only_a": f"only in {a}", "only_b": f"only in {b}"}
    for r in rows:
        if r.identical and not args.all:
            continue
        value = "-" if r.max_abs is None else f"{r.max_abs:.6g}"
        note = notes.get(r.kind) or (f"shape {r.detail}" if r.kind == "shape" else r.detail)
        table.add_row(escape(r.key), value, escape(note or ("identical" if r.identical else "")))
    counts = {k: sum(r.kind == k for r in rows) for k in ("only_a", "only_b", "shape")}
    same = sum(r.identical for r in rows)
    if table.row_count:
        out.print(table)
    out.print(
        escape(
            f"{len(rows)} keys: {same} identical, {len(rows) - same - sum(counts.values())} differ, "
            f"{counts['shape']} shape mismatches, {counts['only_a']} only in {a}, "
            f"{counts['only_b']} only in {b}"
        )
    )
    return EXIT_OK if same == len(rows) else EXIT_PROBLEMS


# ---- arguments -----------------------------------------------------------------------------------------


def add_inspect(subs: Any) -> None:
    p = command(
        subs,
        "inspect",
        cmd_inspect,
        "show a checkpoint's keys, shapes, dtypes and sizes, and its manifest",
        "  safepoint inspect runs/ckpt\n  safepoint inspect runs/ckpt --step 1000 --verify\n"
        "  safepoint inspect runs/ckpt --json",
    )
    add_root(p)
    add_step(p)
    add_flag(p, "--verify", "verify every file first (default: .metadata only)")
    add_flag(p, "--json", "print JSON instead of tables")


class _DiffPaths(argparse.Action):
    """The positional arguments of diff, checked for shape while parsing (a wrong shape is a usage error)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        why = tools_diff.shape_error(list(values))
        if why is not None:
            parser.error(why)
        setattr(namespace, self.dest, list(values))


def add_diff(subs: Any) -> None:
    p = command(
        subs,
        "diff",
        cmd_diff,
        "per-tensor max abs difference between two checkpoints (of one root, or of two)",
        "  safepoint diff runs/ckpt 1000 2000\n  safepoint diff runs/ckpt 1000 2000 --model-only --all\n"
        "  safepoint diff runs/reference runs/resumed            # the newest step both hold\n"
        "  safepoint diff runs/reference runs/resumed --step 1000\n"
        "  safepoint diff runs/a/step-1000 runs/b/step-1200\n"
        "\nexit 0 if every key is bitwise identical, 1 if anything differs (like diff(1)).",
    )
    p.add_argument(
        "paths",
        metavar="ROOT A B | ROOT_A ROOT_B | PATH_A/step-N PATH_B/step-M",
        nargs="+",
        action=_DiffPaths,
        help="two steps of one root; two roots (step --step N, else the newest both hold); two step paths",
    )
    add_step(p)
    add_flag(p, "--model-only", "compare the model weights only")
    add_flag(p, "--all", "also list identical keys")
