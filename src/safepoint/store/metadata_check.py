"""``.metadata`` as a hostile root may have written it: its bytes checked against the manifest before it is
unpickled (allowlisted classes only), then its structure: every storage path a bare name the manifest
lists, offsets and lengths inside that file, every field of DCP's type (docs/reliability.md, "Threat
model"). Its own module: it reads with storage.py's safe unpickler, and storage.py opens files with
guard.py's checks, so neither of those two may import it.
"""

from __future__ import annotations

import io

import crc32c
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from safepoint.errors import CorruptCheckpointError
from safepoint.store.guard import METADATA_FILE, bare_name_problem
from safepoint.store.storage import safe_load_metadata


def _is_index(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_shape(v: object, dims: int | None = None) -> bool:
    return isinstance(v, torch.Size) and all(_is_index(d) for d in v) and (dims is None or len(v) == dims)


def metadata_problem(md: Metadata, sizes: dict[str, int]) -> str | None:
    """Why ``md`` cannot be a checkpoint's metadata whose files have ``sizes`` (the manifest's), or None.

    Storage paths must be bare names the manifest lists (an absolute path or ``..`` would read outside
    the checkpoint, another bucket on S3); every item must lie inside its file (a past-the-end offset or a
    4 GiB length would otherwise read elsewhere or allocate at will); every field must have DCP's type.
    """
    entries = md.state_dict_metadata
    if not isinstance(entries, dict) or not all(isinstance(k, str) for k in entries):
        return "state_dict_metadata is not a {name: metadata} dict"
    for key, entry in entries.items():
        if problem := _entry_problem(entry):
            return f"entry {key!r}: {problem}"
    if md.planner_data is not None and not isinstance(md.planner_data, dict):
        return f"planner_data is a {type(md.planner_data).__name__}, not a dict"
    if not isinstance(md.storage_data, dict):
        return f"storage_data is a {type(md.storage_data).__name__}, not a dict"
    for index, info in md.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            return f"storage_data key {index!r} is not a MetadataIndex"
        if problem := _storage_problem(info, sizes):
            return f"item {index.fqn!r}: {problem}"
    return None


def _entry_problem(entry: object) -> str | None:
    if isinstance(entry, BytesStorageMetadata):
        return None
    if not isinstance(entry, TensorStorageMetadata):
        return f"a {type(entry).__name__}, not tensor or bytes metadata"
    if not isinstance(entry.properties, TensorProperties) or not isinstance(
        entry.properties.dtype, torch.dtype
    ):
        return "tensor properties without a dtype"
    if not _is_shape(entry.size) or not isinstance(entry.chunks, list):
        return "malformed size or chunk list"
    for chunk in entry.chunks:
        if not isinstance(chunk, ChunkStorageMetadata):
            return f"a chunk is a {type(chunk).__name__}"
        dims = len(entry.size)
        if not (_is_shape(chunk.offsets, dims) and _is_shape(chunk.sizes, dims)):
            return "a chunk's offsets or sizes do not match the tensor's dimensions"
        if any(o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, entry.size, strict=True)):
            return "a chunk lies outside the tensor"
    return None


def _storage_problem(info: object, sizes: dict[str, int]) -> str | None:
    if not isinstance(info, _StorageInfo):
        return f"storage info is a {type(info).__name__}"
    if problem := bare_name_problem(info.relative_path):
        return f"storage path {problem}"
    if info.relative_path not in sizes or info.relative_path == METADATA_FILE:
        return f"storage path {info.relative_path!r} is not a data file the manifest lists"
    if not (_is_index(info.offset) and _is_index(info.length)):
        return f"offset {info.offset!r} and length {info.length!r} must be non-negative integers"
    if info.offset + info.length > sizes[info.relative_path]:
        return (
            f"bytes {info.offset}..{info.offset + info.length} lie outside {info.relative_path!r} "
            f"({sizes[info.relative_path]} bytes)"
        )
    descriptors = info.transform_descriptors
    if descriptors is not None and not (
        isinstance(descriptors, list | tuple) and all(isinstance(d, str) for d in descriptors)
    ):
        return "transform descriptors are not a list of names"
    return None


def load_checked_metadata(step: int, data: bytes, files: dict[str, tuple[int, str]]) -> Metadata:
    """``.metadata`` from ``data``: its bytes checked against the manifest (``files``: name -> (size,
    crc32c)), unpickled with the allowlist, then its structure checked. CorruptCheckpointError otherwise."""
    if METADATA_FILE not in files:
        raise CorruptCheckpointError(step, METADATA_FILE, "not listed in the manifest (not a DCP checkpoint)")
    size, crc = files[METADATA_FILE]
    actual = f"{crc32c.crc32c(data):08x}"
    if len(data) != size or actual != crc:
        why = f"size {len(data)}, crc32c {actual}; the manifest says {size}, {crc}"
        raise CorruptCheckpointError(step, METADATA_FILE, f"{why} (changed after verification?)")
    try:
        md = safe_load_metadata(io.BytesIO(data))
    except CorruptCheckpointError as e:
        raise type(e)(step, METADATA_FILE, e.reason) from None
    try:
        problem = metadata_problem(md, {name: s for name, (s, _) in files.items()})
    except AttributeError as e:
        # Unpickling restores whatever state the bytes carry: an allowed class can come back without a
        # field its __init__ would have set.
        problem = f"an object lacks its field {e.name!r}" if e.name else f"an object lacks a field ({e})"
    if problem:
        raise CorruptCheckpointError(step, METADATA_FILE, problem)
    return md
