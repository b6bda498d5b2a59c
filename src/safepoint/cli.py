"""The ``safepoint`` command line: see what is in a checkpoint root, trust it, get a model out of it.

Argument parsing and rendering (rich tables and progress bars) only; the work is done in tools.py with the
same modules the manager uses.

Exit codes: 0 success; 1 a checkpoint is damaged (verify found problems, or a command refused to read a
corrupt checkpoint) or, for ``diff``, the two steps differ; 2 usage errors and anything else that stopped
the command (missing root or step, a live writer holding the root, an unreadable input file).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.filesize import decimal
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from safepoint import tools
from safepoint._version import __version__
from safepoint.errors import CheckpointError, CorruptCheckpointError
from safepoint.layout import Layout
from safepoint.manifest import Manifest
from safepoint.policy import build_retention
from safepoint.state import MODEL

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_ERROR = 2
# Subcommands implemented in their own modules, imported only when used; they parse their own arguments.
_PASSTHROUGH = {
    "demo": "train, get SIGKILLed partway, resume, and check the final weights bit for bit",
    "bench": "run the benchmark suite (save/restore against plain DCP, torch.save, dd)",
}
_STATUS_STYLE = {tools.OK: "green", tools.CORRUPT: "bold red", tools.PARTIAL: "yellow"}


class UsageError(CheckpointError):
    """Arguments that parse but do not make sense together."""


# ---- rendering helpers -------------------------------------------------------------------------------


def _console(*, stderr: bool = False) -> Console:
    # Piped output: wide enough that long tensor names are not wrapped mid-line for grep and friends.
    width = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 200
    return Console(stderr=stderr, highlight=False, width=width)


@contextmanager
def _progress(err: Console, description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A byte progress bar on stderr (only on a terminal: logs and pipes stay clean)."""
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    )
    with progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)


def _when(t: float | None) -> str:
    return "-" if t is None else datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _metrics(m: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.6g}" for k, v in sorted(m.items()))


def _verified(layout: Layout, step: int, err: Console) -> Manifest:
    manifest = layout.read_manifest(step)
    with _progress(err, f"verifying step {step}", manifest.total_bytes) as advance:
        return tools.require_intact(layout, step, lambda _name, size: advance(size))


def _load(layout: Layout, step: int, err: Console, include: tools.Include) -> dict[str, Any]:
    manifest = _verified(layout, step, err)
    metadata = tools.read_verified_metadata(layout, step, manifest)
    with _progress(err, f"reading step {step}", tools.planned_bytes(metadata, include)) as advance:
        return tools.load_state(layout, step, metadata, include, advance)


# ---- commands ----------------------------------------------------------------------------------------


def cmd_ls(args: argparse.Namespace, out: Console, err: Console) -> int:
    layout = tools.open_any_root(args.root)
    entries = tools.scan(layout, verify=args.verify)
    if args.json:
        print(json.dumps([e.to_json() for e in entries], indent=2))
        return EXIT_OK
    if not entries:
        out.print(f"no checkpoints in {escape(str(layout.root))}")
        return EXIT_OK
    table = Table(title=escape(str(layout.root)), title_justify="left")
    problems = any(e.reason for e in entries)
    for col in ("step", "time", "size", "status", "tier", "metrics", *(["problem"] if problems else [])):
        table.add_column(col, justify="right" if col in ("step", "size") else "left")
    for e in entries:
        status = f"[{_STATUS_STYLE[e.status]}]{e.status}[/]"
        row = [str(e.step), _when(e.time), decimal(e.bytes), status, e.tier, _metrics(e.metrics)]
        table.add_row(*row, *([escape(e.reason or "")] if problems else []))
    out.print(table)
    pending = tools.pending_saves(layout)
    if pending:
        out.print(
            f"[dim]{len(pending)} entr{'y' if len(pending) == 1 else 'ies'} under .pending/ (saves in "
            "progress or abandoned; never listed or loaded)[/]"
        )
    return EXIT_OK


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
        with _progress(err, f"verifying step {s}", total) as advance:
            manifest, problems = tools.verify_step(layout, s, lambda _name, size: advance(size))
        if problems or manifest is None:
            bad += 1
            for p in problems:
                out.print(f"[bold red]CORRUPT[/] {escape(str(p))}")
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


def cmd_inspect(args: argparse.Namespace, out: Console, err: Console) -> int:
    layout = tools.open_root(args.root)
    step = tools.resolve_step(layout, args.step)
    manifest = _verified(layout, step, err) if args.verify else layout.read_manifest(step)
    metadata = tools.read_verified_metadata(layout, step, manifest)
    keys = tools.describe_keys(metadata)
    if args.json:
        doc = {
            "step": manifest.step,
            "path": str(layout.step_path(step)),
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
        ("time", _when(manifest.time)),
        ("world size", str(manifest.world_size)),
        ("host", manifest.host),
        ("save id", manifest.save_id),
        ("sections", ", ".join(manifest.keys)),
        ("versions", " ".join(f"{k}={v}" for k, v in sorted(manifest.versions.items()))),
        ("metrics", _metrics(manifest.metrics) or "-"),
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
    for section in tools.sections_of(k.key for k in keys):
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


def cmd_export(args: argparse.Namespace, out: Console, err: Console) -> int:
    dest = Path(args.out)
    if dest.exists() and not args.force:
        raise UsageError(f"{dest} already exists; pass --force to overwrite it")
    if not dest.parent.is_dir():
        raise UsageError(f"directory {dest.parent} does not exist")
    layout = tools.open_root(args.root)
    step = tools.resolve_step(layout, args.step)
    include = tools.model_only if args.model_only else tools.everything
    if args.model_only and MODEL not in layout.read_manifest(step).keys:
        raise CheckpointError(
            f"step {step} holds no model state (sections: {layout.read_manifest(step).keys})"
        )
    sd = _load(layout, step, err, include)
    obj: dict[str, Any] = sd.get(MODEL, {}) if args.model_only else sd
    if args.dtype:
        dtype = tools.DTYPES[args.dtype]
        # Only the weights: optimizer, RNG and counters hold exact state that rounding would corrupt.
        if args.model_only:
            obj = tools.convert_floats(obj, dtype)
        elif MODEL in obj:
            obj = {**obj, MODEL: tools.convert_floats(obj[MODEL], dtype)}
    skipped: list[str] = []
    with err.status(f"writing {dest}"):
        if args.format == "torch":
            tools.write_torch(obj, dest)
        else:
            meta = {
                "format": "pt",
                "safepoint.step": str(step),
                tools.SAFETENSORS_LAYOUT_KEY: "model" if args.model_only else "full",
            }
            skipped = tools.write_safetensors(obj, dest, meta)
    what = "model" if args.model_only else "full state"
    dtype_note = f", floats as {args.dtype}" if args.dtype else ""
    out.print(
        f"exported step {step} ({what}{dtype_note}) to {escape(str(dest))}: {decimal(dest.stat().st_size)}"
    )
    if skipped:
        out.print(
            f"[yellow]note[/]: safetensors holds tensors only; left out {len(skipped)} non-tensor values "
            f"({escape(', '.join(skipped[:5]))}{', ...' if len(skipped) > 5 else ''}); use --format torch "
            "to keep them"
        )
    return EXIT_OK


def cmd_import(args: argparse.Namespace, out: Console, err: Console) -> int:
    layout = tools.open_root(args.root, must_exist=False)
    model_sd, dropped = tools.read_import_source(Path(args.src), args.format)
    with err.status(f"writing step 0 to {layout.root}"):
        info = tools.import_state(model_sd, layout, force=args.force)
    n = sum(1 for v in model_sd.values() if isinstance(v, torch.Tensor))
    out.print(
        f"imported {n} tensors from {escape(args.src)} as step 0 in {escape(info.path)} "
        f"({decimal(info.bytes)})"
    )
    if dropped:
        out.print(f"[yellow]note[/]: imported the model only; left out {', '.join(dropped)}")
    newer = [s for s in layout.committed_steps() if s > 0]
    if newer:
        out.print(
            f"[yellow]note[/]: {layout.root} also holds newer steps {newer[-5:]}; restore() picks the "
            "newest, use restore(state, step=0) for this one"
        )
    return EXIT_OK


def cmd_prune(args: argparse.Namespace, out: Console, err: Console) -> int:
    if args.keep_last is None and args.keep_every is None and args.keep_best is None:
        raise UsageError("say what to keep: --keep-last N, --keep-every N and/or --keep-best N --metric NAME")
    try:
        retention = build_retention(args.keep_last, args.keep_every, args.keep_best, args.metric, args.mode)
    except ValueError as e:
        raise UsageError(str(e)) from None
    layout = tools.open_root(args.root)
    kept, deleted = tools.prune(layout, retention, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    for s in deleted:
        out.print(f"{verb} step {s}")
    out.print(f"kept {len(kept)}: {kept}; {verb} {len(deleted)}")
    left = [e for e in tools.scan(layout) if e.status != tools.OK]
    if left:
        out.print(
            f"[yellow]note[/]: left alone (not committed or unreadable): "
            f"{', '.join(f'step {e.step} ({e.status})' for e in left)}"
        )
    return EXIT_OK


def cmd_diff(args: argparse.Namespace, out: Console, err: Console) -> int:
    layout = tools.open_root(args.root)
    a, b = tools.resolve_step(layout, args.a), tools.resolve_step(layout, args.b)
    include = tools.model_only if args.model_only else tools.everything
    rows = tools.diff_states(_load(layout, a, err, include), _load(layout, b, err, include))
    table = Table(title=f"step {a} vs step {b}", title_justify="left")
    table.add_column("key", overflow="fold")
    table.add_column("max abs diff", justify="right")
    table.add_column("note")
    notes = {"only_a": f"only in step {a}", "only_b": f"only in step {b}"}
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
        f"{len(rows)} keys: {same} identical, {len(rows) - same - sum(counts.values())} differ, "
        f"{counts['shape']} shape mismatches, {counts['only_a']} only in step {a}, "
        f"{counts['only_b']} only in step {b}"
    )
    return EXIT_OK if same == len(rows) else EXIT_PROBLEMS


# ---- parser ------------------------------------------------------------------------------------------


def _sub(subs: Any, name: str, help: str, epilog: str) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subs.add_parser(
        name,
        help=help,
        description=help,
        epilog="examples:\n" + epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return p


def _step_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--step", type=_nonneg, metavar="N", help="checkpoint step (default: the newest)")


def _nonneg(s: str) -> int:
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _positive(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="safepoint",
        description="Inspect, verify and convert safepoint checkpoint roots.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n  safepoint ls runs/ckpt\n  safepoint verify runs/ckpt --all\n"
            "  safepoint export runs/ckpt model.safetensors --format safetensors --model-only\n\n"
            "exit codes: 0 ok; 1 a damaged checkpoint (or, for diff, differences); 2 usage or other errors.\n"
            "`safepoint COMMAND --help` for each command."
        ),
    )
    parser.add_argument("--version", action="version", version=f"safepoint {__version__}")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = _sub(
        subs,
        "ls",
        "list the checkpoints in ROOT (step, time, size, status, tier, metrics)",
        "  safepoint ls runs/ckpt\n  safepoint ls runs/ckpt --json | jq '.[] | select(.status != \"ok\")'\n"
        "\nstatus: ok = committed (manifest parses and self-verifies); corrupt = the manifest (or, with\n"
        "--verify, a file) is damaged; partial = a step directory without a manifest (never committed).",
    )
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.add_argument(
        "--verify", action="store_true", help="also check every file's size and crc32c (reads all)"
    )
    p.set_defaults(func=cmd_ls)

    p = _sub(
        subs,
        "verify",
        "check size and crc32c of every file of a checkpoint against its manifest",
        "  safepoint verify runs/ckpt            # the newest checkpoint\n"
        "  safepoint verify runs/ckpt --step 1000\n  safepoint verify runs/ckpt --all && echo intact\n"
        "\nexit 0 only if every checked checkpoint is intact; one line per problem (step, file, reason).",
    )
    p.add_argument("root", metavar="ROOT")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--step", type=_nonneg, metavar="N", help="checkpoint step (default: the newest)")
    g.add_argument("--all", action="store_true", help="verify every committed checkpoint")
    p.set_defaults(func=cmd_verify)

    p = _sub(
        subs,
        "inspect",
        "show a checkpoint's keys, shapes, dtypes and sizes, and its manifest",
        "  safepoint inspect runs/ckpt\n  safepoint inspect runs/ckpt --step 1000 --verify\n"
        "  safepoint inspect runs/ckpt --json",
    )
    p.add_argument("root", metavar="ROOT")
    _step_arg(p)
    p.add_argument("--verify", action="store_true", help="verify every file first (default: .metadata only)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=cmd_inspect)

    p = _sub(
        subs,
        "export",
        "write a checkpoint as one torch.save or safetensors file (verified first)",
        "  safepoint export runs/ckpt model.pt --format torch --model-only\n"
        "  safepoint export runs/ckpt model.safetensors --format safetensors --model-only --dtype bf16\n"
        "  safepoint export runs/ckpt full.pt --format torch --step 1000\n\n"
        "--model-only writes the model's state_dict (model.load_state_dict(torch.load(OUT)) works);\n"
        "otherwise the whole state, nested by section (model, optimizer, scheduler, rng, ...).\n"
        "--dtype converts the model's floating-point tensors only.",
    )
    p.add_argument("root", metavar="ROOT")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--format", choices=("torch", "safetensors"), required=True)
    _step_arg(p)
    p.add_argument("--model-only", action="store_true", help="only the model weights, without the prefix")
    p.add_argument("--dtype", choices=sorted(tools.DTYPES), help="convert floating-point model tensors")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    p.set_defaults(func=cmd_export)

    p = _sub(
        subs,
        "import",
        "turn a torch.save or safetensors state dict into a step-0 checkpoint",
        "  safepoint import pretrained.pt runs/ckpt\n  safepoint import model.safetensors runs/ckpt --force\n"
        "\nThe file must hold a model state_dict ({name: tensor}) or be a safepoint export; its tensors go\n"
        "under the model section, so CheckpointManager(ROOT).restore(TrainState(model=m)) loads them.\n"
        "torch files are read with torch.load(weights_only=True): no arbitrary unpickling.",
    )
    p.add_argument("src", metavar="SRC")
    p.add_argument("root", metavar="ROOT")
    p.add_argument(
        "--format",
        choices=("auto", "torch", "safetensors"),
        default="auto",
        help="input format (default: by extension, .safetensors or torch)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing step 0")
    p.set_defaults(func=cmd_import)

    p = _sub(
        subs,
        "prune",
        "delete old checkpoints with the manager's retention policies",
        "  safepoint prune runs/ckpt --keep-last 3 --dry-run\n  safepoint prune runs/ckpt --keep-last 2\n"
        "  safepoint prune runs/ckpt --keep-last 1 --keep-best 2 --metric loss\n\n"
        "The newest checkpoint is never deleted. Refuses while a live writer holds ROOT's lease.",
    )
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--keep-last", type=_positive, metavar="N", help="keep the N newest")
    p.add_argument("--keep-every", type=_positive, metavar="N", help="keep steps that are multiples of N")
    p.add_argument("--keep-best", type=_positive, metavar="N", help="keep the N best by --metric")
    p.add_argument("--metric", help="metric name for --keep-best")
    p.add_argument("--mode", choices=("min", "max"), default="min", help="best = min (default) or max")
    p.add_argument("--dry-run", action="store_true", help="show what would be deleted; delete nothing")
    p.set_defaults(func=cmd_prune)

    p = _sub(
        subs,
        "diff",
        "per-tensor max abs difference between two checkpoints",
        "  safepoint diff runs/ckpt 1000 2000\n  safepoint diff runs/ckpt 1000 2000 --model-only --all\n"
        "\nexit 0 if every key is bitwise identical, 1 if anything differs (like diff(1)).",
    )
    p.add_argument("root", metavar="ROOT")
    p.add_argument("a", metavar="A", type=_nonneg, help="step A")
    p.add_argument("b", metavar="B", type=_nonneg, help="step B")
    p.add_argument("--model-only", action="store_true", help="compare the model weights only")
    p.add_argument("--all", action="store_true", help="also list identical keys")
    p.set_defaults(func=cmd_diff)

    for name, help in _PASSTHROUGH.items():
        subs.add_parser(name, help=help, add_help=False)
    return parser


def _passthrough(name: str, rest: list[str]) -> int:
    module = f"safepoint.{name}"
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise UsageError(f"`safepoint {name}` is not available in this build ({module} is missing)") from None
    return int(mod.main(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv and argv[0] in _PASSTHROUGH:
            return _passthrough(argv[0], argv[1:])
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # argparse: 2 for usage errors, 0 for --help/--version
            return e.code if isinstance(e.code, int) else EXIT_ERROR
        return int(args.func(args, _console(), _console(stderr=True)))
    except CorruptCheckpointError as e:
        print(f"safepoint: error: {e}", file=sys.stderr)
        return EXIT_PROBLEMS
    except CheckpointError as e:
        print(f"safepoint: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as e:
        print(
            f"safepoint: error: {e.strerror or e}{f': {e.filename}' if e.filename else ''}", file=sys.stderr
        )
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("safepoint: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
