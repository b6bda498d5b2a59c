"""Per-rank sections (RNG, data position, extra) in one small file per rank, not in DCP's ``.metadata``.

Kept in DCP's state dict, each rank's sections add ~3.4 KB per rank to the global ``.metadata`` that every
rank reads at load (34 MB at 10,000 ranks, read 10,000 times). Instead each rank writes its own sections
to ``rank-<r>.state`` next to the DCP files (``torch.save`` of ``{section: value}``); its size and crc32c
ride to rank 0 on DCP's write collective like every other file (store/file_report.py) and are listed in
the manifest, so verification covers it. At load each rank reads only the file of the saved rank it takes
over (``sources``), checks it against the manifest as it reads, and unpickles it with torch's weights-only
rules. ``.metadata`` stays plain DCP: ``dcp.load`` reads model and optimizer without safepoint.

Checkpoints written before this (the sections inside ``.metadata``, no ``rank-*.state`` in the manifest)
load as before: ``split_sections`` leaves their sections in the DCP template.
"""

from __future__ import annotations

import io
import os
import posixpath
from pathlib import Path
from typing import Any

import crc32c
import torch

from safepoint.data.rng import rng_problem
from safepoint.errors import CorruptCheckpointError, UnsafeCheckpointError, weights_only_reason
from safepoint.state import PER_RANK_SECTIONS, RNG, rank_key
from safepoint.store.checksum import crc_hex
from safepoint.store.guard import read_up_to
from safepoint.store.manifest import Manifest
from safepoint.store.rank_bytes import saved_bytes
from safepoint.store.rootfs import around


def file_name(rank: int) -> str:
    return f"rank-{rank}.state"


def split_sections(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the state dict without per-rank sections, the per-rank sections ``{section: {rank_r: value}}``)."""
    rest = {k: v for k, v in state_dict.items() if k not in PER_RANK_SECTIONS}
    return rest, {k: v for k, v in state_dict.items() if k in PER_RANK_SECTIONS}


def write(layout: Any, pending: Any, rank: int, sections: dict[str, Any]) -> dict[str, tuple[int, str]]:
    """Write this rank's sections into the save's ``pending`` location; returns ``{name: (size, crc)}``
    (empty when there are none). ``pending`` is a directory (Layout) or an object key prefix (store)."""
    if not sections:
        return {}
    # torch.save's bytes, from a template where the sections are plain tensors (the RNG states)
    data, name = saved_bytes({s: v[rank_key(rank)] for s, v in sections.items()}), file_name(rank)
    if isinstance(pending, Path):
        # Through the guarded walk (store/rootfs.py): a link planted at the name is unlinked, never written
        # through. fsync'd: committed with the rest (DCP fsyncs its files, the commit the directory).
        target = pending / name
        around(target, getattr(layout, "fs", None)).write(target, data)
    else:
        layout.store.put_bytes(posixpath.join(pending, name), data)
    return {name: (len(data), crc_hex(crc32c.crc32c(data)))}


def saved_separately(manifest: Manifest) -> bool:
    """Whether this checkpoint keeps per-rank sections in rank files (else inside ``.metadata``)."""
    return file_name(0) in manifest.files


def read(layout: Any, manifest: Manifest, source: int, sections: list[str]) -> dict[str, Any]:
    """``{section: {rank_<source>: value}}`` for ``sections``, from saved rank ``source``'s file, checked
    against the manifest (size and crc32c) as read, loaded weights-only."""
    step, name = manifest.step, file_name(source)
    entry = manifest.files.get(name)
    if entry is None:
        raise CorruptCheckpointError(step, name, "missing from the manifest (the rank's RNG, data position)")
    try:
        base = layout.step_path(step)
        # Per-node tiers (tiers/node_view.py) say where each file is read from: this node's disk, a peer's
        # replica or the durable tier; another rank's file is not on this node's disk.
        resolve = getattr(layout, "paths", None)
        if resolve is not None or isinstance(base, Path):
            path = Path(resolve([name])[name]) if resolve is not None else base / name
            # No symlink on the way from the layout's root, no FIFO or device (store/rootfs.py).
            with os.fdopen(around(path, getattr(layout, "fs", None)).open_read(path), "rb") as f:
                data = read_up_to(f, entry.size + 1)
        else:
            data = layout.store.get_bytes(posixpath.join(layout.step_key(step), name))
    except Exception as e:  # OSError, or the store's error: the file cannot be read as listed
        raise CorruptCheckpointError(step, name, f"cannot read ({e})") from None
    if len(data) != entry.size:
        raise CorruptCheckpointError(step, name, f"size {len(data)} != {entry.size} (truncated or extended)")
    if (crc := crc_hex(crc32c.crc32c(data))) != entry.crc32c:
        raise CorruptCheckpointError(step, name, f"crc32c {crc} != {entry.crc32c} (contents altered)")
    try:
        loaded = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # UnpicklingError for anything outside the allowlist
        raise UnsafeCheckpointError(
            step, name, f"not loadable weights-only ({weights_only_reason(e)})"
        ) from None
    missing = [s for s in sections if not isinstance(loaded, dict) or s not in loaded]
    if missing:
        raise CorruptCheckpointError(step, name, f"holds no {missing[0]!r} section")
    # Checked here, before DCP loads a byte in place: a forged RNG state (-1 as a word) would otherwise
    # raise OverflowError from random.setstate after the model was overwritten, with no fallback.
    if RNG in sections and (problem := rng_problem(loaded[RNG])) is not None:
        raise CorruptCheckpointError(step, name, f"not an RNG state safepoint writes ({problem})")
    return {s: {rank_key(source): loaded[s]} for s in sections}
