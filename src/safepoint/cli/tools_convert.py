"""``safepoint export`` and ``import``: one torch.save or safetensors file out of a checkpoint, and back.

Files are written through a temporary sibling and renamed; imports commit through the real save path and
read torch files with ``weights_only=True``, so a crafted file cannot run code.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from safepoint.dist import Comm
from safepoint.errors import CheckpointError
from safepoint.policy.rules import Retention
from safepoint.save.saver import SyncSaver
from safepoint.state import MODEL
from safepoint.store.heartbeat import DEFAULT_STALE_AFTER_S
from safepoint.store.manifest import ORIGIN_IMPORT, ORIGIN_KEY
from safepoint.store.posix_layout import CheckpointInfo, Layout

# Marks a safetensors file written by a full (not --model-only) export, whose keys carry section prefixes.
SAFETENSORS_LAYOUT_KEY = "safepoint.layout"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def convert_floats(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: convert_floats(v, dtype) for k, v in obj.items()}
    return obj


def _atomic_write(out: Path, write: Callable[[Path], None]) -> None:
    """Write ``out`` through a temporary sibling and rename: a killed export never leaves half a file."""
    tmp = out.with_name(f".{out.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def write_torch(obj: dict[str, Any], out: Path) -> None:
    _atomic_write(out, lambda p: torch.save(obj, p))


def _safetensors() -> Any:
    try:
        import safetensors.torch as st
    except ImportError:
        raise CheckpointError(
            "the safetensors format needs the safetensors package: pip install 'safepoint[safetensors]'"
        ) from None
    return st


def write_safetensors(obj: dict[str, Any], out: Path, meta: dict[str, str]) -> list[str]:
    """Flatten to dotted keys and write the tensors; returns the keys of non-tensor values left out
    (safetensors holds tensors only)."""
    st = _safetensors()
    flat, _ = flatten_state_dict(obj)
    tensors = {k: v.contiguous() for k, v in flat.items() if isinstance(v, torch.Tensor)}
    skipped = sorted(k for k, v in flat.items() if not isinstance(v, torch.Tensor))
    _atomic_write(out, lambda p: st.save_file(tensors, str(p), metadata=meta))
    return skipped


# ---- import ------------------------------------------------------------------------------------------


def read_import_source(src: Path, fmt: str) -> tuple[dict[str, Any], list[str]]:
    """The model state dict held by ``src`` and the top-level sections that were left out.

    Accepted: a flat ``{name: tensor}`` state dict (torch.save or safetensors), or a dict with a nested
    ``model`` state dict such as a full safepoint export (only ``model`` is taken; optimizer and other
    state is not in safepoint's format and is not imported).
    """
    if not src.is_file():
        raise CheckpointError(f"{src} does not exist or is not a file")
    if fmt == "auto":
        fmt = sniff_format(src)
    dropped: list[str] = []
    if fmt == "safetensors":
        st = _safetensors()
        try:
            flat: dict[str, Any] = st.load_file(str(src))
            from safetensors import safe_open

            with safe_open(str(src), framework="pt") as f:
                meta = f.metadata() or {}
        except Exception as e:
            raise CheckpointError(f"cannot read {src} as safetensors: {e}") from None
        if meta.get(SAFETENSORS_LAYOUT_KEY) == "full":
            prefix = MODEL + "."
            dropped = sorted({k.split(".", 1)[0] for k in flat if not k.startswith(prefix)})
            flat = {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}
        model = flat
    else:
        try:
            # weights_only: tensors and plain containers only; a crafted pickle cannot run code.
            obj = torch.load(src, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(
                f"cannot read {src} as a torch.save file of plain tensors (torch.load with weights_only=True "
                f"refused it: {_weights_only_reason(e)})"
            ) from None
        if not isinstance(obj, Mapping):
            raise CheckpointError(f"{src} holds a {type(obj).__name__}, not a state dict")
        # A nested "model" mapping is unambiguous (a flat state dict maps names to tensors): a safepoint
        # export, or a training checkpoint like {"model": ..., "optimizer": ..., "epoch": 3}.
        if isinstance(obj.get(MODEL), Mapping):
            dropped = sorted(str(k) for k in obj if k != MODEL)
            obj = obj[MODEL]
        model = dict(obj)
    _check_flat_state_dict(src, model)
    return model, dropped


def sniff_format(src: Path) -> str:
    """'safetensors' or 'torch', from the first bytes rather than the name (files get renamed)."""
    with open(src, "rb") as f:
        head = f.read(9)
    # safetensors: u64 little-endian header length, then the JSON header; torch.save: a zip ("PK") or a
    # legacy pickle.
    if len(head) == 9 and head[8:9] == b"{" and not head.startswith(b"PK"):
        return "safetensors"
    return "torch"


def _weights_only_reason(e: Exception) -> str:
    # torch's message is mostly boilerplate around one informative line (the blocked global, say).
    boiler = (
        "Weights only load failed",
        "Please file an issue",
        "Check the documentation",
        "WeightsUnpickler",
    )
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.strip().startswith(boiler)]
    return " ".join(lines) or type(e).__name__


def _check_flat_state_dict(src: Path, sd: Mapping[Any, Any]) -> None:
    if not any(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(
            f"{src} holds no tensors at the top level (keys: {sorted(map(str, sd))[:8]}); expected a model "
            "state_dict or a safepoint export"
        )
    for k, v in sd.items():
        if not isinstance(k, str):
            raise CheckpointError(f"{src}: state dict key {k!r} is not a string")
        if isinstance(v, (Mapping, list, tuple)):
            raise CheckpointError(
                f"{src}: entry {k!r} is a {type(v).__name__}, not a tensor: the file is not a flat model "
                "state_dict (save model.state_dict() itself)"
            )


def import_state(model_sd: dict[str, Any], layout: Layout, *, force: bool) -> CheckpointInfo:
    """Commit ``model_sd`` as step 0 through the real save path (DCP write, crc32c, manifest, rename)."""
    layout.ensure_root()
    lease = layout.lease(DEFAULT_STALE_AFTER_S)  # fences every delete/commit through layout
    lease.acquire()
    try:
        if 0 in layout.committed_steps() and not force:
            raise CheckpointError(f"{layout.step_path(0)} already exists; pass --force to replace it")
        saver = SyncSaver(layout, Comm(), Retention())
        return saver.write(0, {MODEL: model_sd}, [MODEL], {}, {}, manifest_extra={ORIGIN_KEY: ORIGIN_IMPORT})
    finally:
        lease.release()
