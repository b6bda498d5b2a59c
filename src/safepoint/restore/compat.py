"""What a restore checks before DCP loads a byte: the state against ``.metadata`` (one error listing every
key that differs), and the report of what a restore loaded. Split from restorer.py, which runs them."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from safepoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    StateMismatchError,
    describe_exception,
)
from safepoint.restore.partial import STRICT_HINT, Plan, RestoreReport
from safepoint.state import KEYED_SECTIONS
from safepoint.store.guard import open_regular
from safepoint.store.item_check import FileRange, items_problem
from safepoint.store.storage import METADATA_NAME

_SHOW = 8


class NotLoadable(Exception):
    """Raised inside DCP's planning step: this rank found the checkpoint corrupt or not matching the state
    (``error``). DCP hands it to every rank inside its CheckpointException."""

    def __init__(self, error: CheckpointError) -> None:
        super().__init__(str(error))
        self.error = error

    def __reduce__(self) -> tuple[type, tuple[CheckpointError]]:
        return type(self), (self.error,)


def report(
    step: int, source: str, matched: Plan | None, absent: list[str], ignored: list[str]
) -> RestoreReport:
    found = matched.report if matched is not None else {}
    return RestoreReport(
        step=step,
        source=source,
        loaded=len(matched.pairs) if matched is not None else 0,
        missing=tuple(absent + found.get("missing", [])),
        unexpected=tuple(found.get("unexpected", [])),
        mismatched=tuple(found.get("mismatched", [])),
        ignored=tuple(ignored + found.get("ignored", [])),
        remapped=tuple(found.get("remapped", [])),
    )


def check_compat(step: int, template: dict[str, Any], metadata: Metadata) -> None:
    """Compare what we are about to load into with what the checkpoint holds; one clear error listing all."""
    flat, _ = flatten_state_dict(template)
    saved = metadata.state_dict_metadata
    missing = [k for k in flat if k not in saved]
    mismatched: list[str] = []
    for key, value in flat.items():
        md = saved.get(key)
        if md is None:
            continue
        if isinstance(value, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                mismatched.append(f"{key}: checkpoint holds a non-tensor value, the target is a tensor")
            elif tuple(md.size) != tuple(value.shape):
                mismatched.append(f"{key}: checkpoint shape {tuple(md.size)} vs target {tuple(value.shape)}")
        elif isinstance(md, TensorStorageMetadata):
            mismatched.append(f"{key}: checkpoint holds a tensor, the target is {type(value).__name__}")
    prefixes = tuple(section_prefixes(template))
    unexpected = [k for k in saved if k.startswith(prefixes) and k not in flat]
    if missing or mismatched or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing from the checkpoint: {_few(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} in the checkpoint but not in the target: {_few(unexpected)}")
        if mismatched:
            parts.append(f"{len(mismatched)} mismatched: {_few(mismatched)}")
        raise StateMismatchError(
            f"checkpoint step {step} does not match the state being restored (wrong model or config?): "
            + "; ".join(parts)
            + STRICT_HINT
        )


def section_prefixes(template: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for section, value in template.items():
        if section in KEYED_SECTIONS and isinstance(value, dict):
            out.extend(f"{section}.{k}." for k in value)
        else:
            out.append(f"{section}.")
    return out


def _few(items: list[str]) -> str:
    shown = ", ".join(sorted(items)[:_SHOW])
    return shown + (f", ... (+{len(items) - _SHOW} more)" if len(items) > _SHOW else "")


def damage_first(
    layout: Any, step: int, metadata: Metadata | None, error: CheckpointError
) -> CheckpointError:
    """What a StateMismatchError really is: if ``.metadata``'s items are not what its data files hold (a
    forged shape, re-pointed offsets: store/item_check.py, the check `verify` runs), the checkpoint is
    corrupt ("warn, fall back"), not a model that does not fit; a mismatch against a checkpoint whose
    items are whole is the user's to fix, as before. Checked only once a mismatch is found: the headers
    are read then, never on a restore that fits."""
    if metadata is None or not isinstance(error, StateMismatchError):
        return error
    try:
        problem = items_problem(metadata, file_ranges(layout, step))
    except Exception as e:  # a store's own error type: the items cannot be read as listed
        problem = (METADATA_NAME, f"cannot read the items it describes ({describe_exception(e)})")
    if problem is None:
        return error
    return CorruptCheckpointError(step, problem[0], problem[1])


def file_ranges(layout: Any, step: int) -> FileRange:
    """A FileRange over ``step``'s files on ``layout``: an object store's ranged reads, a per-node view's
    resolved paths (its own disk, a peer replica, a download), else the local step directory."""
    if hasattr(layout, "read_range"):
        return lambda name, off, n: bytes(layout.read_range(step, name, off, n))
    resolve = getattr(layout, "paths", None)
    base = layout.step_path(step)

    def read(name: str, offset: int, size: int) -> bytes:
        path = resolve([name])[name] if resolve is not None else os.path.join(base, name)
        fd = open_regular(path)
        try:
            data = os.pread(fd, size, offset)
        finally:
            os.close(fd)
        if len(data) != size:
            raise OSError(f"{name} ended at byte {offset + len(data)}")
        return data

    return read
