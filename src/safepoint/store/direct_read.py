"""Read a saved tensor straight into its destination instead of through ``torch.load`` and ``copy_``.

DCP stores every tensor as one ``torch.save`` zip (``data.pkl`` describing the tensor, ``data/<key>`` holding
its raw bytes, ``byteorder``) inside a rank's ``.distcp`` file. DCP's reader ``torch.load``s each item into
freshly allocated memory and then copies it into the destination: three copies of every byte plus a fresh
allocation, which faults in slowly on VMs. When the item holds exactly the destination tensor (same dtype
and shape, contiguous, no offset, the host's byte order), its data record can be read with one ``preadv``
into the destination's memory instead.

What is trusted from the file, and why that is safe: the zip directory gives only an offset and a size,
and both are bounds-checked against the item; the read always fills exactly the destination's bytes.
``data.pkl`` is unpickled by torch's own weights-only unpickler on a storage that holds no data, so the
description is checked (dtype, shape, layout, one storage read whole) without loading anything. A crafted
file can at worst put bytes of its choosing into a tensor, which crafting the tensor data could do anyway.
Integrity: a restore verifies every file's crc32c before it reads any of them, and the reader checks the
crc32c of what it actually read (``read_in_place`` returns the item's), so a file replaced in between is
caught too.

Anything unusual (another dtype or layout, a slice of the saved tensor, a ZIP64 item over 4 GiB, another
byte order, a compressed record) returns False, and the caller takes DCP's general path.
"""

from __future__ import annotations

import ctypes
import io
import os
import struct
import sys
from collections.abc import Callable
from typing import Any

import crc32c
import torch
import torch._weights_only_unpickler
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from safepoint.errors import CheckpointError
from safepoint.store.checksum import fd_range_crc32c

# The central directory of a one-tensor torch.save is 7 entries (~600 bytes) plus the end records (~100):
# one read of the item's last few KiB holds all of it.
_TAIL = 4096
# Pieces of a tensor read (os.preadv takes at most ~2 GiB per call).
_READ_PIECE = 64 * 1024 * 1024

_EOCD = struct.Struct("<4s4H2IH")  # end of central directory
_CDIR = struct.Struct("<4s6H3I5H2I")  # central directory entry
_LOCAL = struct.Struct("<4s5H3I2H")  # local file header
_NO32 = 0xFFFFFFFF  # ZIP64 placeholder: the real value is elsewhere (not handled: DCP's general path)
_BYTEORDER = sys.byteorder.encode()

# data.pkl bytes -> (dtype, shape, storage key, storage bytes), or None if not a plain whole tensor. Tensors
# of one shape pickle identically, so a model's few hundred items need only a handful of unpicklings.
Described = tuple[torch.dtype, tuple[int, ...], str, int]
# Also (dtype, shape, item length) -> (data offset, bytes before the data, bytes after it) of small items.
Layout = tuple[int, bytes, bytes]
DescriptionCache = dict[Any, Any]
Read = Callable[[int, int], bytes]  # (offset within the item, size) -> bytes
# Items up to this size are read whole with one call and copied: one system call instead of ~8.
_SMALL = 1024 * 1024


def read_in_place(
    fd: int,
    md: _StorageInfo,
    req: ReadItem,
    target: torch.Tensor,
    cache: DescriptionCache,
    crc: int = 0,
) -> int | None:
    """Read the item's tensor into ``target`` if it is exactly that tensor and return ``crc`` extended by
    the crc32c of the item's bytes (all of them: headers read here, the data as it lands); None (nothing
    touched) if not. Chaining the file's running crc32c through the items costs nothing; combining
    per-item checksums afterwards cost more than the reads for thousands of small items."""
    if (
        type(target) is not torch.Tensor
        or target.device.type != "cpu"
        or target.layout != torch.strided
        or target.is_quantized
        # A conjugate or negative view's memory holds conj(x) or -x: raw bytes would land flipped.
        or target.is_conj()
        or target.is_neg()
        or not target.is_contiguous()
        or any(req.storage_offsets)
        or tuple(req.lengths) != tuple(target.shape)
    ):
        return None
    nbytes = target.numel() * target.element_size()
    if md.length <= _SMALL:
        return _read_small(fd, md, target, nbytes, cache, crc)
    found = _locate(_file_reader(fd, md), md.length, target.dtype, tuple(target.shape), nbytes, cache)
    if found is None:
        return None
    offset = found[0]
    what = f"item {req.storage_index.fqn!r}"
    crc = fd_range_crc32c(fd, md.offset, offset, what, crc)
    crc = _pread_into(fd, target.data_ptr(), nbytes, md.offset + offset, req, crc)
    tail_at = offset + nbytes
    return fd_range_crc32c(fd, md.offset + tail_at, md.length - tail_at, what, crc)


def _read_small(
    fd: int, md: _StorageInfo, target: torch.Tensor, nbytes: int, cache: DescriptionCache, crc: int
) -> int | None:
    """A small item: read whole with one call, found in memory, copied into ``target``."""
    raw = bytearray(md.length)
    if os.preadv(fd, [raw], md.offset) != md.length:
        return None  # cut short: DCP's path reads it again and says so
    view = memoryview(raw)
    key = (target.dtype, tuple(target.shape), md.length)
    # Items of one shape share every byte around their data: a layout already parsed and checked for an
    # item with the same bytes before and after the data is this item's layout too.
    known = cache.get(key)
    if known is not None and view[: known[0]] == known[1] and view[known[0] + nbytes :] == known[2]:
        offset = known[0]
    else:
        found = _locate(lambda at, n: bytes(view[at : at + n]), md.length, key[0], key[1], nbytes, cache)
        if found is None:
            return None
        offset, cacheable = found
        if cacheable:
            cache[key] = (offset, bytes(view[:offset]), bytes(view[offset + nbytes :]))
    if nbytes:
        ctypes.memmove(target.data_ptr(), (ctypes.c_char * nbytes).from_buffer(raw, offset), nbytes)
    return crc32c.crc32c(raw, crc)


def _file_reader(fd: int, md: _StorageInfo) -> Read:
    return lambda at, n: os.pread(fd, n, md.offset + at)


def _locate(
    read: Read,
    length: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    nbytes: int,
    cache: DescriptionCache,
) -> tuple[int, bool] | None:
    """Offset within the item of the data record of a (dtype, shape) tensor of ``nbytes``, or None; and
    whether nothing that decided it lies within the data (so items with the same other bytes agree)."""
    found = _directory(read, length)
    if found is None:
        return None
    records, structure_at = found
    by_leaf = {name.partition("/")[2]: entry for name, entry in records.items()}
    byteorder = _record(read, length, by_leaf.get("byteorder"))
    pickled = _record(read, length, by_leaf.get("data.pkl"))
    if byteorder != _BYTEORDER or pickled is None:
        return None
    if pickled not in cache:
        cache[pickled] = _describe(pickled)
    described = cache[pickled]
    if not isinstance(described, tuple) or described[:2] != (dtype, shape) or described[3] != nbytes:
        return None
    data = by_leaf.get(f"data/{described[2]}")
    if data is None or data[1] != nbytes:
        return None
    offset = _data_offset(read, length, data)
    if offset is None:
        return None
    end = offset + nbytes
    outside = structure_at >= end and all(
        _clear_of(read, length, e, offset, end) for e in (by_leaf["byteorder"], by_leaf["data.pkl"])
    )
    return offset, outside


def _clear_of(read: Read, length: int, entry: tuple[int, int], offset: int, end: int) -> bool:
    """Whether a record (local header and bytes) lies wholly before ``offset`` or from ``end`` on."""
    start = _data_offset(read, length, entry)
    return start is not None and (start + entry[1] <= offset or entry[0] >= end)


def _directory(read: Read, length: int) -> tuple[dict[str, tuple[int, int]], int] | None:
    """{record name: (local header offset, size)} of the item's zip, stored (uncompressed) records only;
    and where the central directory starts."""
    tail_len = min(length, _TAIL)
    tail_at = length - tail_len
    tail = read(tail_at, tail_len)
    end = tail.rfind(b"PK\x05\x06")
    if len(tail) != tail_len or end < 0 or end + _EOCD.size > len(tail):
        return None
    _sig, _disk, _cd_disk, _n_here, count, cd_size, cd_offset, _comment = _EOCD.unpack_from(tail, end)
    start = cd_offset - tail_at
    if cd_offset == _NO32 or start < 0 or start + cd_size > end:
        return None
    records = central_directory(tail, start, end, count)
    return None if records is None else (records, cd_offset)


def central_directory(buf: bytes, pos: int, end: int, count: int) -> dict[str, tuple[int, int]] | None:
    """{record name: (local header offset, size)} from the ``count`` entries of a zip's central directory
    in ``buf[pos:end]``; None unless every entry is a stored (uncompressed), non-ZIP64, uniquely named
    record."""
    records: dict[str, tuple[int, int]] = {}
    for _ in range(count):
        if pos + _CDIR.size > end:
            return None
        fields = _CDIR.unpack_from(buf, pos)
        sig, method, csize, usize, nlen, elen, clen, header = (
            fields[i] for i in (0, 4, 8, 9, 10, 11, 12, 16)
        )
        if sig != b"PK\x01\x02" or method != 0 or csize != usize or _NO32 in (usize, header):
            return None
        name = buf[pos + _CDIR.size : pos + _CDIR.size + nlen].decode("utf-8", "replace")
        if name in records:
            return None
        records[name] = (header, usize)
        pos += _CDIR.size + nlen + elen + clen
    return records


def _data_offset(read: Read, length: int, entry: tuple[int, int]) -> int | None:
    """Where a record's bytes start within the item (after its local header), bounds-checked."""
    header, size = entry
    if header + _LOCAL.size > length:
        return None
    local = read(header, _LOCAL.size)
    if len(local) != _LOCAL.size:
        return None
    fields = _LOCAL.unpack(local)
    if fields[0] != b"PK\x03\x04":
        return None
    start = header + _LOCAL.size + fields[9] + fields[10]
    return start if start + size <= length else None


def _record(read: Read, length: int, entry: tuple[int, int] | None) -> bytes | None:
    """A small record's bytes (data.pkl, byteorder)."""
    if entry is None or entry[1] > 1024 * 1024:
        return None
    start = _data_offset(read, length, entry)
    if start is None:
        return None
    data = read(start, entry[1])
    return data if len(data) == entry[1] else None


def _describe(pickled: bytes) -> Described | None:
    """What data.pkl describes, if it is one plain contiguous tensor over the whole of one storage."""
    storages: list[tuple[str, int]] = []

    def persistent_load(saved_id: Any) -> Any:
        # torch.load's own storage ids: ("storage", <storage type>, key, location, numel).
        _kind, storage_type, key, _location, numel = saved_id
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        nbytes = int(numel) * dtype.itemsize
        storages.append((str(key), nbytes))
        # A storage that holds no data: what is built on it is a meta tensor, a description only.
        meta = torch.UntypedStorage(nbytes, device="meta")  # type: ignore[no-untyped-call]
        return torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
            wrap_storage=meta, dtype=dtype, _internal=True
        )

    try:
        unpickler = torch._weights_only_unpickler.Unpickler(io.BytesIO(pickled), encoding="utf-8")
        unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
        saved = unpickler.load()  # type: ignore[no-untyped-call]
    except Exception:
        # Whatever it holds, DCP's general (weights-only) path decides what to make of it.
        return None
    if (
        type(saved) is not torch.Tensor
        or saved.is_conj()
        or saved.is_neg()
        or len(storages) != 1
        or saved.storage_offset() != 0
        or saved.layout != torch.strided
        or not saved.is_contiguous()
        or storages[0][1] != saved.numel() * saved.element_size()
    ):
        return None
    return saved.dtype, tuple(saved.shape), storages[0][0], storages[0][1]


def _pread_into(fd: int, address: int, nbytes: int, position: int, req: ReadItem, value: int) -> int:
    """Read ``nbytes`` at ``position`` into memory at ``address``; ``value`` extended by the crc32c of
    what landed there (each piece checksummed right after its read, while it is in the CPU cache)."""
    done = 0
    while done < nbytes:
        n = min(_READ_PIECE, nbytes - done)
        buf = (ctypes.c_char * n).from_address(address + done)
        got = os.preadv(fd, [buf], position + done)
        if got <= 0:
            # Only possible if the file changed after it was verified.
            raise CheckpointError(
                f"item {req.storage_index.fqn!r}: the file ended {nbytes - done} bytes early "
                "(changed after it was verified?)"
            )
        value = crc32c.crc32c(memoryview(buf)[:got], value)
        done += got
    return value
