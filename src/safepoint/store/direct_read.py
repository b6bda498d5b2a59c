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
from typing import Any

import crc32c
import torch
import torch._weights_only_unpickler
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from safepoint.errors import CheckpointError
from safepoint.store.checksum import crc32c_combine, fd_range_crc32c

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
DescriptionCache = dict[bytes, Described | None]


def read_in_place(
    fd: int, md: _StorageInfo, req: ReadItem, target: torch.Tensor, cache: DescriptionCache
) -> int | None:
    """Read the item's tensor into ``target`` if it is exactly that tensor and return the crc32c of the
    item's bytes (all of them: headers read here, the data as it lands); None (nothing touched) if not."""
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
    offset = _locate(fd, md, target.dtype, tuple(target.shape), nbytes, cache)
    if offset is None:
        return None
    what = f"item {req.storage_index.fqn!r}"
    head = fd_range_crc32c(fd, md.offset, offset, what)
    data = _pread_into(fd, target.data_ptr(), nbytes, md.offset + offset, req)
    tail_at = offset + nbytes
    tail = fd_range_crc32c(fd, md.offset + tail_at, md.length - tail_at, what)
    return crc32c_combine(crc32c_combine(head, data, nbytes), tail, md.length - tail_at)


def _locate(
    fd: int,
    md: _StorageInfo,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    nbytes: int,
    cache: DescriptionCache,
) -> int | None:
    """Offset within the item of the data record of a (dtype, shape) tensor of ``nbytes``, or None."""
    records = _directory(fd, md)
    if records is None:
        return None
    by_leaf = {name.partition("/")[2]: entry for name, entry in records.items()}
    byteorder = _record(fd, md, by_leaf.get("byteorder"))
    pickled = _record(fd, md, by_leaf.get("data.pkl"))
    if byteorder != _BYTEORDER or pickled is None:
        return None
    if pickled not in cache:
        cache[pickled] = _describe(pickled)
    described = cache[pickled]
    if described is None or described[:2] != (dtype, shape) or described[3] != nbytes:
        return None
    data = by_leaf.get(f"data/{described[2]}")
    if data is None or data[1] != nbytes:
        return None
    return _data_offset(fd, md, data)


def _directory(fd: int, md: _StorageInfo) -> dict[str, tuple[int, int]] | None:
    """{record name: (local header offset, size)} of the item's zip, stored (uncompressed) records only."""
    tail_len = min(md.length, _TAIL)
    tail_at = md.length - tail_len
    tail = os.pread(fd, tail_len, md.offset + tail_at)
    end = tail.rfind(b"PK\x05\x06")
    if len(tail) != tail_len or end < 0 or end + _EOCD.size > len(tail):
        return None
    _sig, _disk, _cd_disk, _n_here, count, cd_size, cd_offset, _comment = _EOCD.unpack_from(tail, end)
    start = cd_offset - tail_at
    if cd_offset == _NO32 or start < 0 or start + cd_size > end:
        return None
    records: dict[str, tuple[int, int]] = {}
    pos = start
    for _ in range(count):
        if pos + _CDIR.size > end:
            return None
        fields = _CDIR.unpack_from(tail, pos)
        sig, method, csize, usize, nlen, elen, clen, header = (
            fields[i] for i in (0, 4, 8, 9, 10, 11, 12, 16)
        )
        if sig != b"PK\x01\x02" or method != 0 or csize != usize or _NO32 in (usize, header):
            return None
        name = tail[pos + _CDIR.size : pos + _CDIR.size + nlen].decode("utf-8", "replace")
        if name in records:
            return None
        records[name] = (header, usize)
        pos += _CDIR.size + nlen + elen + clen
    return records


def _data_offset(fd: int, md: _StorageInfo, entry: tuple[int, int]) -> int | None:
    """Where a record's bytes start within the item (after its local header), bounds-checked."""
    header, size = entry
    if header + _LOCAL.size > md.length:
        return None
    local = os.pread(fd, _LOCAL.size, md.offset + header)
    if len(local) != _LOCAL.size:
        return None
    fields = _LOCAL.unpack(local)
    if fields[0] != b"PK\x03\x04":
        return None
    start = header + _LOCAL.size + fields[9] + fields[10]
    return start if start + size <= md.length else None


def _record(fd: int, md: _StorageInfo, entry: tuple[int, int] | None) -> bytes | None:
    """A small record's bytes (data.pkl, byteorder)."""
    if entry is None or entry[1] > 1024 * 1024:
        return None
    start = _data_offset(fd, md, entry)
    if start is None:
        return None
    data = os.pread(fd, entry[1], md.offset + start)
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


def _pread_into(fd: int, address: int, nbytes: int, position: int, req: ReadItem) -> int:
    """Read ``nbytes`` at ``position`` into memory at ``address``; the crc32c of what landed there (each
    piece checksummed right after its read, while it is in the CPU cache)."""
    done, value = 0, 0
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
