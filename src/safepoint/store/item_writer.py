"""Write a rank's DCP items without calling ``torch.save`` once per tensor, in DCP's exact on-disk format.

DCP's ``FileSystemWriter`` stores every tensor item as one ``torch.save`` zip inside the rank's ``.distcp``
file, and ``dcp.load`` (and safepoint's reader) read each item as such a zip. For thousands of small tensors
``torch.save`` costs ~0.5 ms each (pickling, zip headers, end records) and hands the stream hundreds of
thousands of tiny writes. Here each item's bytes are produced from a *template*: ``torch.save`` of a tensor of
the same dtype, shape and strides, taken once, split around its data record. With torch's per-record CRC-32
off (safepoint's writes turn it off: ``crc_switch.torch_crc32_off``), nothing else in a one-tensor
``torch.save`` depends on the data, so template head + the tensor's bytes + template tail is byte for byte
what ``torch.save`` writes. That is checked when a template is made (two saves of different data must share
head and tail, and the data record must hold exactly the tensor's bytes); any tensor that does not qualify,
or any check that fails, goes through ``torch.save`` itself. Small pieces are gathered into one buffer and
written with one call, so the checksumming stream sees a few large writes.
"""

from __future__ import annotations

import ctypes
import io
import logging
import os
import pickle
import queue
import struct
import threading
import zipfile
from typing import IO, Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from safepoint.store.crc_switch import torch_crc32_off

# Pieces below this are copied into the batch buffer; bigger tensor data is written straight from the
# tensor's memory (one copy fewer, and the checksumming stream overlaps its crc32c with the write).
_DIRECT_MIN = 256 * 1024
# The batch buffer is written out once it holds this much.
_BATCH = 4 * 1024 * 1024
# Templates are few (one per distinct dtype/shape/stride); a state with endlessly varied shapes must not
# grow the cache without bound.
_MAX_TEMPLATES = 4096
# Tensors above this go through torch.save itself: its fixed cost is noise next to their bytes, and a
# template of a big tensor would cost two torch.saves of it (and their memory) to make and check.
_TEMPLATE_MAX = 1024 * 1024
_LOCAL = struct.Struct("<4s5H3I2H")

Template = tuple[bytes, bytes]  # (head, tail) around the tensor's bytes
_templates: dict[tuple[Any, ...], Template | None] = {}
_templates_lock = threading.Lock()
log = logging.getLogger("safepoint")


# ctypes makes a new array type per length (~8 us): one per distinct tensor size, reused.
_array_types: dict[int, Any] = {}
# A byte item (a non-tensor value: a learning rate, betas, a step count) whose pickle is larger than this is
# serialised afresh every save rather than remembered (byte_item): the memory the cache holds stays small.
BYTE_CACHE_MAX = 64 * 1024
# Named tensors only exist in some builds; the check costs ~2 us per tensor where they do not.
_HAS_NAMES = hasattr(torch.Tensor, "names")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor's memory (no copy); ``t`` must outlive the view."""
    n = t.numel() * t.element_size()
    array = _array_types.get(n)
    if array is None:
        if len(_array_types) >= _MAX_TEMPLATES:
            _array_types.clear()
        array = _array_types[n] = ctypes.c_char * n
    return memoryview(array.from_address(t.data_ptr())).cast("B")


def _plain(t: torch.Tensor) -> bool:
    """Whether ``torch.save(t)`` is a function of dtype, shape, strides and the raw bytes only."""
    return (
        type(t) is torch.Tensor
        and t.is_cpu
        and t.layout == torch.strided
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
        and not t.requires_grad
        and not (_HAS_NAMES and any(n is not None for n in t.names))  # type: ignore[attr-defined]
        and 0 < t.numel() * t.element_size() <= _TEMPLATE_MAX
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        # What torch._utils._get_obj_state finds on an exact torch.Tensor (no slots): its __dict__.
        and not t.__dict__
    )


def _saved(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _split(raw: bytes, data: memoryview) -> Template | None:
    """(head, tail) of a one-tensor torch.save around its data record, if that record holds ``data``."""
    try:
        infos = zipfile.ZipFile(io.BytesIO(raw)).infolist()
    except zipfile.BadZipFile:
        return None
    records = [i for i in infos if i.filename.endswith("/data/0")]
    if len(records) != 1 or records[0].file_size != len(data) or records[0].compress_type != 0:
        return None
    at = records[0].header_offset
    fields = _LOCAL.unpack_from(raw, at)
    start = at + _LOCAL.size + fields[9] + fields[10]
    if raw[start : start + len(data)] != data:
        return None
    return raw[:start], raw[start + len(data) :]


def _make_template(t: torch.Tensor) -> Template | None:
    data = tensor_bytes(t)
    first = _split(_saved(t), data)
    # The same shape with every byte flipped: anything in head or tail that depended on the data shows.
    flipped = torch.bitwise_not(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    other = torch.empty_like(t, memory_format=torch.contiguous_format)
    ctypes.memmove(other.data_ptr(), flipped.data_ptr(), data.nbytes)
    second = _split(_saved(other), tensor_bytes(other))
    return first if first is not None and first == second else None


def template_for(t: torch.Tensor) -> Template | None:
    """The (head, tail) that ``torch.save(t)`` puts around ``t``'s bytes, or None: use torch.save."""
    if torch.serialization.get_crc32_options():
        return None
    return _template(t, torch.serialization._get_storage_alignment())


def _template(t: torch.Tensor, alignment: int) -> Template | None:
    """``template_for`` with torch's settings read once per file by the caller (~25 us each)."""
    if not _plain(t):
        return None
    key = (t.dtype, tuple(t.shape), t.stride(), alignment)
    try:
        return _templates[key]
    except KeyError:
        pass
    made = _make_template(t)
    with _templates_lock:  # writer threads share the cache; another may clear it meanwhile
        if len(_templates) >= _MAX_TEMPLATES:
            _templates.clear()
        _templates[key] = made
    return made


class _NoClose:
    """What torch.save writes through for a fallback item: the stream stays open for the next item."""

    def __init__(self, out: BatchedStream) -> None:
        self._out = out

    def write(self, data: Any) -> int:
        return self._out.write(data)

    def flush(self) -> None:
        pass


class BatchedStream:
    """Gathers small writes into one buffer; big pieces go straight to the stream. Tracks the position."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self._buf = bytearray()
        self.pos = stream.tell()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if n >= _DIRECT_MIN:
            self.flush()
            self._write_all(view)
        else:
            self._buf += view
            if len(self._buf) >= _BATCH:
                self.flush()
        self.pos += n
        return n

    def write_small(self, *pieces: bytes | memoryview) -> None:
        """Append small pieces (each under the direct-write threshold) to the buffer."""
        buf = self._buf
        for piece in pieces:
            buf += piece
            self.pos += len(piece)
        if len(buf) >= _BATCH:
            self.flush()

    def flush(self) -> None:
        if self._buf:
            self._write_all(memoryview(self._buf))
            self._buf = bytearray()

    def _write_all(self, view: memoryview) -> None:
        while view.nbytes:
            n = self._stream.write(view)
            if not n:
                raise OSError(f"short write: {view.nbytes} bytes could not be written")
            view = view[n:]


def write_items(
    stream: IO[bytes],
    file_name: str,
    items: list[WriteItem],
    planner: SavePlanner,
) -> list[WriteResult]:
    """Write ``items`` to ``stream`` exactly as DCP's writer would (byte items first, then tensors)."""
    out = BatchedStream(stream)
    results: list[WriteResult] = []
    # Templates hold only while torch writes no CRC-32 (it would depend on the data); read once per file.
    alignment = (
        None if torch.serialization.get_crc32_options() else torch.serialization._get_storage_alignment()
    )
    ordered = [i for i in items if i.type == WriteItemType.BYTE_IO]
    ordered += [i for i in items if i.type != WriteItemType.BYTE_IO]
    flat = default_lookup(planner)
    cache: dict[str, tuple[bytes, bytes]] | None = getattr(planner, "byte_items", None)
    for item in ordered:
        offset = out.pos
        if item.type == WriteItemType.BYTE_IO:
            out.write(byte_item(planner, item, flat, cache))
        else:
            _write_tensor(out, _resolve_tensor(planner, item, flat), alignment)
        length = out.pos - offset
        info = _StorageInfo(file_name, offset, length)
        results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
    out.flush()
    return results


def byte_item(
    planner: SavePlanner,
    item: WriteItem,
    flat: dict[str, Any] | None,
    cache: dict[str, tuple[bytes, bytes]] | None,
) -> bytes | memoryview:
    """The bytes DCP writes for a non-tensor item: ``torch.save`` of the value into a buffer (~0.1 ms each,
    a dozen per optimizer; most of a small state's item writes), or, when the value pickles to the same
    bytes as at the previous save, the bytes written then. Safe: equal pickles unpickle to equal values,
    so the remembered bytes are a ``torch.save`` of this very value (what DCP's loader reads back); the
    bytes written, whatever their origin, are checksummed as written like every other byte."""
    fqn = item.index.fqn
    key = None
    if cache is not None and flat is not None and fqn in flat:
        try:
            key = pickle.dumps(flat[fqn], protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # not picklable alone (torch.save may still manage): no cache for it
            key = None
        if key is not None and (hit := cache.get(fqn)) is not None and hit[0] == key:
            return hit[1]
    data = planner.resolve_data(item)
    if not isinstance(data, io.BytesIO):
        raise TypeError(f"item {fqn!r}: DCP byte items must be io.BytesIO")
    if cache is not None:
        if key is not None and len(key) <= BYTE_CACHE_MAX:
            cache[fqn] = (key, data.getvalue())
        else:
            cache.pop(fqn, None)
    return data.getbuffer()


def default_lookup(planner: SavePlanner) -> dict[str, Any] | None:
    """The planner's flattened state dict if it resolves items as DefaultSavePlanner does, else None."""
    if not isinstance(planner, DefaultSavePlanner):
        return None
    kind = type(planner)
    if (
        kind.resolve_data is DefaultSavePlanner.resolve_data
        and kind.lookup_object is DefaultSavePlanner.lookup_object
        and kind.transform_object is DefaultSavePlanner.transform_object
    ):
        return planner.state_dict
    return None


def plain_tensor(flat: dict[str, Any], item: WriteItem) -> torch.Tensor | None:
    """The whole plain tensor ``item`` stands for in ``flat`` (a ``default_lookup``), or None: ask the
    planner. It is what DefaultSavePlanner.resolve_data returns for it (find_tensor_shard: the tensor
    itself when the item's offset is all zeros), found without its per-item checks."""
    tensor = flat.get(item.index.fqn)
    offset = item.index.offset
    if type(tensor) is not torch.Tensor or offset is None or len(offset) != tensor.dim() or any(offset):
        return None
    return tensor


def _resolve_tensor(
    planner: SavePlanner, item: WriteItem, flat: dict[str, Any] | None = None
) -> torch.Tensor:
    # What DCP's _SerialCpuLoader hands to torch.save: detached, on the CPU, with a minimal storage.
    found = plain_tensor(flat, item) if flat is not None else None
    tensor = planner.resolve_data(item) if found is None else found
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"item {item.index.fqn!r}: expected a tensor, got {type(tensor).__name__}")
    tensor = tensor.detach().cpu()
    if tensor.untyped_storage().size() != tensor.nbytes:
        tensor = tensor.clone()
    return tensor


def _write_tensor(out: BatchedStream, tensor: torch.Tensor, alignment: int | None) -> None:
    template = None if alignment is None else _template(tensor, alignment)
    if template is None:
        torch.save(tensor, _NoClose(out))  # type: ignore[arg-type]
        return
    head, tail = template
    data = tensor_bytes(tensor)
    if data.nbytes < _DIRECT_MIN:
        out.write_small(head, data, tail)
    else:
        out.write(head)
        out.write(data)
        out.write(tail)


def write_queue(
    writer: FileSystemWriter, planner: SavePlanner, file_queue: queue.Queue[Any]
) -> list[WriteResult]:
    """Write every file of DCP's ``file_queue`` (path, name, items) on ``writer.thread_count`` threads.

    The main thread's failure raises; an extra thread's failure is logged and its items' results go
    missing, as with DCP's own threads (the caller counts results and raises with the recorded error).
    """
    results: queue.Queue[list[WriteResult]] = queue.Queue()
    threads = [
        threading.Thread(target=_drain, args=(writer, file_queue, results, planner, True))
        for _ in range(1, writer.thread_count)
    ]
    for t in threads:
        t.start()
    try:
        _drain(writer, file_queue, results, planner, False)
    finally:
        for t in threads:
            t.join()
    written: list[WriteResult] = []
    while not results.empty():
        written += results.get_nowait()
    return written


def _drain(
    writer: FileSystemWriter,
    file_queue: queue.Queue[Any],
    results: queue.Queue[list[WriteResult]],
    planner: SavePlanner,
    extra_thread: bool,
) -> None:
    try:
        # In this thread too: torch's switch is per thread in some versions (crc_switch.py).
        with torch_crc32_off():
            _drain_files(writer, file_queue, results, planner)
    except Exception:
        if not extra_thread:
            raise
        log.exception("safepoint: a writer thread failed")


def _drain_files(
    writer: FileSystemWriter,
    file_queue: queue.Queue[Any],
    results: queue.Queue[list[WriteResult]],
    planner: SavePlanner,
) -> None:
    while True:
        try:
            path, file_name, items = file_queue.get_nowait()
        except queue.Empty:
            return
        with writer.fs.create_stream(path, "wb") as stream:
            written = write_items(stream, file_name, items, planner)  # type: ignore[arg-type]
            if writer.sync_files:
                # Flushes the stream's buffer first (ChecksummingWriter.fileno), as DCP relies on.
                os.fsync(stream.fileno())
        results.put(written)
