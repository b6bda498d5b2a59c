"""``safepoint export`` and ``import``: a checkpoint as one file for inference or sharing, and back."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.filesize import decimal
from rich.markup import escape

from safepoint.cli import tools, tools_convert, tools_read
from safepoint.cli.common import EXIT_OK, UsageError, add_flag, add_root, add_step, command, load
from safepoint.errors import CheckpointError
from safepoint.state import MODEL


def cmd_export(args: argparse.Namespace, out: Console, err: Console) -> int:
    dest = Path(args.out)
    if dest.exists() and not args.force:
        raise UsageError(f"{dest} already exists; pass --force to overwrite it")
    if not dest.parent.is_dir():
        raise UsageError(f"directory {dest.parent} does not exist")
    layout = tools.open_root(args.root)
    step = tools.resolve_step(layout, args.step)
    include = tools_read.model_only if args.model_only else tools_read.everything
    if args.model_only and MODEL not in layout.read_manifest(step).keys:
        raise CheckpointError(
            f"step {step} holds no model state (sections: {layout.read_manifest(step).keys})"
        )
    sd = load(layout, step, err, include)
    obj: dict[str, Any] = sd.get(MODEL, {}) if args.model_only else sd
    if args.dtype:
        dtype = tools_convert.DTYPES[args.dtype]
        # Only the weights: optimizer, RNG and counters hold exact state that rounding would corrupt.
        if args.model_only:
            obj = tools_convert.convert_floats(obj, dtype)
        elif MODEL in obj:
            obj = {**obj, MODEL: tools_convert.convert_floats(obj[MODEL], dtype)}
    skipped: list[str] = []
    with err.status(f"writing {dest}"):
        if args.format == "torch":
            tools_convert.write_torch(obj, dest)
        else:
            meta = {
                "format": "pt",
                "safepoint.step": str(step),
                tools_convert.SAFETENSORS_LAYOUT_KEY: "model" if args.model_only else "full",
            }
            skipped = tools_convert.write_safetensors(obj, dest, meta)
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
    model_sd, dropped = tools_convert.read_import_source(Path(args.src), args.format)
    with err.status(f"writing step 0 to {layout.root}"):
        info = tools_convert.import_state(model_sd, layout, force=args.force)
    n = sum(1 for v in model_sd.values() if isinstance(v, torch.Tensor))
    out.print(
        f"imported {n} tensor{'' if n == 1 else 's'} from {escape(args.src)} as step 0 in "
        f"{escape(info.path)} "
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


# ---- arguments -----------------------------------------------------------------------------------------


def add_export(subs: Any) -> None:
    p = command(
        subs,
        "export",
        cmd_export,
        "write a checkpoint as one torch.save or safetensors file (verified first)",
        "  safepoint export runs/ckpt model.pt --format torch --model-only\n"
        "  safepoint export runs/ckpt model.safetensors --format safetensors --model-only --dtype bf16\n"
        "  safepoint export runs/ckpt full.pt --format torch --step 1000\n\n"
        "--model-only writes the model's state_dict (model.load_state_dict(torch.load(OUT)) works);\n"
        "otherwise the whole state, nested by section (model, optimizer, scheduler, rng, ...).\n"
        "--dtype converts the model's floating-point tensors only.",
    )
    add_root(p)
    p.add_argument("out", metavar="OUT")
    p.add_argument("--format", choices=("torch", "safetensors"), required=True)
    add_step(p)
    add_flag(p, "--model-only", "only the model weights, without the prefix")
    p.add_argument(
        "--dtype", choices=sorted(tools_convert.DTYPES), help="convert floating-point model tensors"
    )
    add_flag(p, "--force", "overwrite OUT if it exists")


def add_import(subs: Any) -> None:
    p = command(
        subs,
        "import",
        cmd_import,
        "turn a torch.save or safetensors state dict into a step-0 checkpoint",
        "  safepoint import pretrained.pt runs/ckpt\n  safepoint import model.safetensors runs/ckpt --force\n"
        "\nThe file must hold a model state_dict ({name: tensor}) or be a safepoint export; its tensors go\n"
        "under the model section, so CheckpointManager(ROOT).restore(TrainState(model=m)) loads them.\n"
        "torch files are read with torch.load(weights_only=True): no arbitrary unpickling.",
    )
    p.add_argument("src", metavar="SRC")
    add_root(p)
    p.add_argument(
        "--format",
        choices=("auto", "torch", "safetensors"),
        default="auto",
        help="input format (default: detected from the file's first bytes)",
    )
    add_flag(p, "--force", "replace an existing step 0")
