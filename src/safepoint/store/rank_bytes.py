"""The bytes of a rank file (``torch.save`` of this rank's sections: rank_state.py) from a template.

A rank file is small (the RNG states: six tensors, ~18 KB) but ``torch.save`` of it costs ~0.5-1 ms of CPU
on every save (pickling, a zip record per tensor, end records): a tenth of a small state's save (issue 27).
With torch's per-record CRC-32 off (as for every file safepoint writes: store/crc_switch.py), nothing in a
``torch.save`` of nested dicts of tensors depends on the tensors' values, only on the keys and each
tensor's dtype, shape and strides: so the file saved once, with each tensor's data record overwritten by
the new values, is byte for byte what ``torch.save`` writes. That is checked when a template is made (the
same structure saved again with every data byte flipped must equal the template filled with those bytes);
a structure that fails the check, or holds anything but plain contiguous CPU tensors in dicts with string
keys (a data loader position, ``extra`` values), goes through ``torch.save`` itself. What is read back is
checked as before: the file's crc32c against the manifest, then ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import struct
import threading
import zipfile
from typing import Any

import torch

from safepoint.store import crc_switch
from safepoint.store.crc_switch import torch_crc32_off
from safepoint.store.item_writer import tensor_bytes

_LOCAL = struct.Struct("<4s5H3I2H")  # a zip local file header
_MAX_BYTES = 1 << 20  # larger tensors (none in an RNG state): torch.save's fixed cost is noise there
_MAX_TEMPLATES = 64  # one per structure; a state whose structure keeps changing must not grow the cache

Template = tuple[bytes, tuple[int, ...]]  # the saved file, and where each tensor's data record starts
_templates: dict[tuple[Any, ...], Template | None] = {}
_lock = threading.Lock()


def saved_bytes(payload: dict[str, Any]) -> bytes:
    """What ``torch.save(payload)`` writes with torch's CRC-32 off (see the module docstring)."""
    leaves: list[torch.Tensor] = []
    structure = _structure(payload, leaves)
    if structure is None or len({t.data_ptr() for t in leaves}) != len(leaves):
        return _saved(payload)  # not plain tensors, or two sharing memory: torch.save itself
    # torch's settings that shape the file are part of the key (a template made with CRC-32 off is not
    # what torch.save writes with it on; nor with another storage alignment): the CRC-32 setting as
    # torch_crc32_off leaves it, read without switching it (a filled template runs no torch.save: the
    # switch, ~15 us, is taken only to make a template or to save through torch.save).
    crc = torch.serialization.get_crc32_options() and not crc_switch.SKIP_TORCH_CRC32
    key = (structure, (crc, torch.serialization._get_storage_alignment()))
    try:
        template = _templates[key]
    except KeyError:
        template = _make(payload, leaves)
        with _lock:
            if len(_templates) >= _MAX_TEMPLATES:
                _templates.clear()
            _templates[key] = template
    return _saved(payload) if template is None else _fill(template, leaves)


def _structure(value: Any, leaves: list[torch.Tensor]) -> tuple[Any, ...] | None:
    """The keys, dtypes, shapes and strides of nested dicts of tensors, in pickling order (``leaves``
    gets the tensors in that order); None for anything else."""
    if isinstance(value, torch.Tensor):
        if (
            type(value) is not torch.Tensor
            or value.device.type != "cpu"
            or value.layout != torch.strided
            or value.is_quantized  # its scale and zero point are pickled: not in the key
            or value.is_conj()  # the conj and neg bits are pickled too (and .view(uint8) refuses them)
            or value.is_neg()
            or value.__dict__  # Python attributes: pickled with the tensor, not in the key
            or value.requires_grad
            or not value.is_contiguous()
            or value.storage_offset() != 0
            or value.untyped_storage().nbytes() != value.nbytes
            or value.nbytes > _MAX_BYTES
        ):
            return None
        leaves.append(value)
        return (value.dtype, tuple(value.shape), value.stride())
    if type(value) is not dict or not all(type(k) is str for k in value):
        return None
    out = []
    for k, v in value.items():
        inner = _structure(v, leaves)
        if inner is None:
            return None
        out.append((k, inner))
    return tuple(out)


def _saved(payload: Any) -> bytes:
    buf = io.BytesIO()
    with torch_crc32_off():
        torch.save(payload, buf)
    return buf.getvalue()


def _data(t: torch.Tensor) -> memoryview:
    # A contiguous CPU tensor at offset 0 (_structure): its memory as it lies, without four view calls.
    return tensor_bytes(t) if t.nbytes else memoryview(b"")


def _fill(template: Template, leaves: list[torch.Tensor]) -> bytes:
    raw, starts = template
    out = bytearray(raw)
    for start, t in zip(starts, leaves, strict=True):
        out[start : start + t.nbytes] = _data(t)
    return bytes(out)


def _make(payload: dict[str, Any], leaves: list[torch.Tensor]) -> Template | None:
    raw = _saved(payload)
    try:
        records = {i.filename.rsplit("/", 1)[-1]: i for i in zipfile.ZipFile(io.BytesIO(raw)).infolist()
                   if "/data/" in i.filename}  # fmt: skip
    except zipfile.BadZipFile:
        return None
    starts = []
    for n, t in enumerate(leaves):  # torch.save keys the storages "0", "1", ... in pickling order
        info = records.get(str(n))
        if info is None or info.file_size != t.nbytes or info.compress_type != 0:
            return None
        fields = _LOCAL.unpack_from(raw, info.header_offset)
        start = info.header_offset + _LOCAL.size + fields[9] + fields[10]
        if raw[start : start + t.nbytes] != _data(t):
            return None
        starts.append(start)
    if len(records) != len(leaves):
        return None
    template = (raw, tuple(starts))
    # Every data byte flipped: anything else in the file that depended on the data shows.
    flipped = {id(t): torch.bitwise_not(t.reshape(-1).view(torch.uint8)).view(t.dtype).reshape(t.shape)
               for t in leaves}  # fmt: skip
    other = _replace(payload, flipped)
    other_leaves: list[torch.Tensor] = []
    if _structure(other, other_leaves) is None or _fill(template, other_leaves) != _saved(other):
        return None
    return template


def _replace(value: Any, by_id: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return by_id[id(value)]
    return {k: _replace(v, by_id) for k, v in value.items()}
