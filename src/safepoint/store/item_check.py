"""The structure of a checkpoint's items, checked by reading headers only (``verify``, ``ls --verify``,
``prune``).

Checksums are no MAC: a ``.metadata`` whose offsets are re-pointed inside its own, verified data file (the
manifest re-forged) matches every crc32c and passes metadata_check (every item in range). Restore then
finds no record, or a record of another shape, where ``.metadata`` says an item is, and falls back to an
older step; verification must reach the same verdict, or ``prune --keep-last 1`` keeps the crafted step and
deletes the one restore would use. So every item's byte range must hold what DCP wrote there: one
``torch.save`` zip, whole (it starts with a record and ends with its directory), whose ``data.pkl``
describes, for a tensor item, a tensor of the dtype and chunk shape ``.metadata`` promises, over storages
whose records are in the zip; and no two items may share bytes, unless they are the very same item (two
keys of one tensor, e.g. tied weights, which incremental saves write once).

Cheap: per item, the local header, the zip directory at its end and ``data.pkl`` (a few hundred bytes),
one read for items up to 1 MiB. ``data.pkl`` is unpickled by torch's weights-only unpickler onto storages
that hold no data (meta), as direct_read does, and memoized by its bytes (items of one shape pickle alike).
A ZIP64 item (a record of 4 GiB or more) is checked for its first record only: its directory is elsewhere.
Items with transform descriptors (DCP's compression extensions; safepoint writes none) are checked for
range and overlap only: their bytes are not a zip until transformed.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import torch
import torch._weights_only_unpickler
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from safepoint.store.direct_read import _EOCD, Read, _data_offset, _record, central_directory
from safepoint.store.guard import open_regular

FileRange = Callable[[str, int, int], bytes]
"""(data file name, offset, size) -> those bytes of the checkpoint's file."""
# Items up to this size are read whole with one call (on an object store, one request per item).
_WHOLE = 1024 * 1024
_TAIL = 4096  # the end of an item, where its zip's end record is
_LOCAL_SIG = b"PK\x03\x04"
_ZIP64_SIG = b"PK\x06\x06"
_NO32 = 0xFFFFFFFF  # an item longer than this may be a ZIP64 zip (a record of 4 GiB or more)
# data.pkl bytes -> (dtype, shape, {storage key: bytes}) of the tensor it describes, or why it is none.
Description = tuple[torch.dtype, tuple[int, ...], dict[str, int]] | str


def items_problem(
    md: Metadata, read: FileRange, only: Collection[str] | None = None
) -> tuple[str, str] | None:
    """(data file, reason) for the first item whose bytes are not what ``md`` says they are, or None.

    ``md`` has passed metadata_check (bare names, in range, DCP's types), so ranges are trusted to lie
    inside their files; ``read`` raises OSError if a file cannot be read. ``only``: check the items of
    these files only (a node's local copy holds its own ranks' files)."""
    entries = md.state_dict_metadata
    per_file: dict[str, list[tuple[MetadataIndex, Any]]] = {}
    for index, info in md.storage_data.items():
        per_file.setdefault(info.relative_path, []).append((index, info))
    for name, items in sorted(per_file.items()):
        items.sort(key=lambda x: (x[1].offset, x[1].length))
        for (a, prev), (b, info) in itertools.pairwise(items):
            if (prev.offset, prev.length) == (info.offset, info.length):
                continue  # two keys, one stored item (tied weights, written once): each checked below
            if prev.offset + prev.length > info.offset:
                return name, (
                    f"items {a.fqn!r} (bytes {prev.offset}..{prev.offset + prev.length}) and {b.fqn!r} "
                    f"(from byte {info.offset}) overlap"
                )
    missing = _unstored(md)
    if missing is not None:
        return missing
    descriptions: dict[bytes, Description] = {}
    for name, items in sorted(per_file.items()):
        if only is not None and name not in only:
            continue
        for index, info in items:
            if info.transform_descriptors:
                continue
            entry = entries.get(index.fqn)
            item = _Item(read, name, info.offset, info.length)
            problem = _record_problem(item, index, entry, descriptions)
            if problem:
                return name, f"item {index.fqn!r} at byte {info.offset}: {problem}"
    return None


def _unstored(md: Metadata) -> tuple[str, str] | None:
    """An entry restore would look up in storage_data and not find (a KeyError deep inside DCP's load)."""
    for fqn, entry in md.state_dict_metadata.items():
        wanted = (
            [MetadataIndex(fqn)]
            if isinstance(entry, BytesStorageMetadata)
            else [MetadataIndex(fqn, chunk.offsets) for chunk in entry.chunks]
        )
        for index in wanted:
            if index not in md.storage_data:
                return ".metadata", f"entry {fqn!r} has no stored bytes for chunk {index.offset}"
    return None


class _Item:
    """One item's bytes, read lazily: whole in one call if small, else the pieces asked for."""

    def __init__(self, read: FileRange, name: str, offset: int, length: int) -> None:
        self.length = length
        self._read, self._name, self._offset = read, name, offset
        self._whole: bytes | None = read(name, offset, length) if length <= _WHOLE else None

    def __call__(self, at: int, n: int) -> bytes:
        n = max(0, min(n, self.length - at))
        if self._whole is not None:
            return self._whole[at : at + n]
        return self._read(self._name, self._offset + at, n) if n else b""


def _record_problem(
    item: _Item, index: MetadataIndex, entry: object, descriptions: dict[bytes, Description]
) -> str | None:
    read: Read = item
    if item.length < 4 or read(0, 4) != _LOCAL_SIG:
        return "no torch.save record starts there"
    if item.length > _NO32:
        tail_at = item.length - _TAIL
        if _ZIP64_SIG in read(tail_at, _TAIL):
            return None  # a record of 4 GiB or more: its directory is not where _directory looks
    records = _zip_directory(read, item.length)
    if records is None:
        return "no torch.save record ends there (its zip directory is missing or malformed)"
    if min((header for header, _ in records.values()), default=-1) != 0:
        return "the zip directory does not start at the item"
    by_leaf = {name.partition("/")[2]: entry for name, entry in records.items()}
    pkl = by_leaf.get("data.pkl")
    if pkl is None or _data_offset(read, item.length, pkl) is None:
        return "the record has no readable data.pkl"
    if not isinstance(entry, TensorStorageMetadata):
        # An object (restore unpickles it weights-only and decides; its pickle may be any size), or a
        # storage_data entry no state_dict entry refers to (never read): the structure is enough here.
        return None
    pickled = _record(read, item.length, pkl)
    if pickled is None:
        return "its data.pkl is not a tensor's (over 1 MiB)"
    chunk = next((c for c in entry.chunks if c.offsets == index.offset), None)
    if chunk is None:
        return "no chunk of the tensor starts at this item's offset"
    if pickled not in descriptions:
        descriptions[pickled] = _describe(pickled)
    described = descriptions[pickled]
    if isinstance(described, str):
        return described
    dtype, shape, storages = described
    want_dtype, want_shape = entry.properties.dtype, tuple(chunk.sizes)
    if (dtype, shape) != (want_dtype, want_shape):
        return f"holds a {dtype} tensor of shape {shape}; .metadata says {want_dtype} of shape {want_shape}"
    for key, nbytes in storages.items():
        data = by_leaf.get(f"data/{key}")
        if data is None or data[1] < nbytes or _data_offset(read, item.length, data) is None:
            return f"the tensor's storage record data/{key} is missing or short"
    return None


def _zip_directory(read: Read, length: int) -> dict[str, tuple[int, int]] | None:
    """{record name: (local header offset, size)} of the item's zip, stored (uncompressed) records only.

    direct_read's parser looks for the directory in the item's last 4 KiB, which holds a tensor's; an
    object with many tensors inside has a longer one, so it is read where the end record says it is."""
    tail_len = min(length, _TAIL)
    tail = read(length - tail_len, tail_len)
    end = tail.rfind(b"PK\x05\x06")
    if end < 0 or end + _EOCD.size > len(tail):
        return None
    _sig, _disk, _cd_disk, _here, count, cd_size, cd_offset, _comment = _EOCD.unpack_from(tail, end)
    if cd_offset == _NO32 or cd_offset + cd_size > length - tail_len + end:
        return None
    directory = read(cd_offset, cd_size)
    return central_directory(directory, 0, len(directory), count)


def _describe(pickled: bytes) -> Description:
    """What ``data.pkl`` describes, unpickled weights-only onto storages that hold no data."""
    storages: dict[str, int] = {}

    def persistent_load(saved_id: Any) -> Any:
        _kind, storage_type, key, _location, numel = saved_id
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        nbytes = int(numel) * dtype.itemsize
        storages[str(key)] = max(nbytes, storages.get(str(key), 0))
        meta = torch.UntypedStorage(nbytes, device="meta")  # type: ignore[no-untyped-call]
        return torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
            wrap_storage=meta, dtype=dtype, _internal=True
        )

    try:
        unpickler = torch._weights_only_unpickler.Unpickler(io.BytesIO(pickled), encoding="utf-8")
        unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
        saved = unpickler.load()  # type: ignore[no-untyped-call]
    except Exception as e:
        # Refused (not plain data) or no pickle at all: either way not the tensor .metadata promises.
        why = str(e).strip().splitlines()
        return f"its data.pkl is not a plain tensor ({type(e).__name__}: {why[-1] if why else ''})"
    if not isinstance(saved, torch.Tensor):
        return f"holds a {type(saved).__name__}, not a tensor"
    return saved.dtype, tuple(saved.shape), storages


@contextlib.contextmanager
def local_ranges(step_dir: Path) -> Iterator[FileRange]:
    """A FileRange over ``step_dir``'s files: regular files only, never through a symlink (guard)."""
    fds: dict[str, int] = {}

    def read(name: str, offset: int, size: int) -> bytes:
        if name not in fds:
            fds[name] = open_regular(step_dir / name)
        data = os.pread(fds[name], size, offset)
        if len(data) != size:
            raise OSError(f"{name} ended at byte {offset + len(data)} (changed while verified?)")
        return data

    try:
        yield read
    finally:
        for fd in fds.values():
            os.close(fd)
