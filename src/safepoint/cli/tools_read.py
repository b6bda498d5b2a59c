"""Reading a verified checkpoint without a model or a process group: keys, shapes and the whole state.

Nothing here unpickles arbitrary objects: ``.metadata`` goes through the restricted unpickler (after its
bytes are checked against the manifest) and every item through ``weights_only=True``.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from safepoint.errors import CheckpointError, CorruptCheckpointError, describe_exception
from safepoint.state import MODEL, SECTIONS
from safepoint.store.checksum import crc_hex
from safepoint.store.layout import Layout
from safepoint.store.manifest import Manifest
from safepoint.store.storage import METADATA_NAME, SafeLoadPlanner, SafeReader, safe_load_metadata

Include = Callable[[str], bool]


def everything(_key: str) -> bool:
    return True


def model_only(key: str) -> bool:
    return key.startswith(MODEL + ".")


def read_verified_metadata(layout: Layout, step: int, manifest: Manifest) -> Metadata:
    """DCP metadata of ``step``, checked against the manifest from the very bytes that are unpickled.

    Reading once and checking those bytes leaves no window in which the file could change between the
    check and the (restricted) unpickling.
    """
    entry = manifest.files.get(METADATA_NAME)
    if entry is None:
        raise CorruptCheckpointError(step, METADATA_NAME, "not listed in the manifest (not a DCP checkpoint)")
    try:
        data = (layout.step_path(step) / METADATA_NAME).read_bytes()
    except OSError as e:
        raise CorruptCheckpointError(step, METADATA_NAME, f"cannot read ({e.strerror or e})") from None
    if len(data) != entry.size:
        raise CorruptCheckpointError(step, METADATA_NAME, f"size {len(data)} != {entry.size}")
    crc = crc_hex(crc32c.crc32c(data))
    if crc != entry.crc32c:
        raise CorruptCheckpointError(
            step, METADATA_NAME, f"crc32c {crc} != {entry.crc32c} (contents altered)"
        )
    try:
        return safe_load_metadata(io.BytesIO(data))
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(step, METADATA_NAME, e.reason) from None


@dataclasses.dataclass(frozen=True, slots=True)
class KeyInfo:
    """One entry of a checkpoint as ``inspect`` shows it."""

    key: str
    section: str
    kind: str
    """'tensor' or 'object' (a non-tensor value, stored pickled and read with weights_only=True)."""
    shape: tuple[int, ...] | None
    dtype: str | None
    bytes: int
    """In-memory size for tensors; serialized size on disk for objects."""


def describe_keys(metadata: Metadata) -> list[KeyInfo]:
    stored: dict[str, int] = {}
    for index, where in (metadata.storage_data or {}).items():
        stored[index.fqn] = stored.get(index.fqn, 0) + int(getattr(where, "length", 0) or 0)
    out = []
    for key, md in metadata.state_dict_metadata.items():
        section = key.split(".", 1)[0]
        if isinstance(md, TensorStorageMetadata):
            out.append(
                KeyInfo(
                    key, section, "tensor", tuple(md.size), dtype_name(md.properties.dtype), tensor_nbytes(md)
                )
            )
        else:
            out.append(KeyInfo(key, section, "object", None, None, stored.get(key, 0)))
    return out


def sections_of(keys: Iterable[str]) -> list[str]:
    return sorted(
        {k.split(".", 1)[0] for k in keys}, key=lambda s: (SECTIONS.index(s) if s in SECTIONS else 99, s)
    )


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


# ---- reading a whole checkpoint without a model ------------------------------------------------------


def tensor_nbytes(md: TensorStorageMetadata) -> int:
    return math.prod(md.size) * md.properties.dtype.itemsize


def planned_bytes(metadata: Metadata, include: Include = everything) -> int:
    return sum(
        tensor_nbytes(v)
        for k, v in metadata.state_dict_metadata.items()
        if include(k) and isinstance(v, TensorStorageMetadata)
    )


class _MaterializingPlanner(SafeLoadPlanner):
    """Builds the state dict from the metadata (like DCP's ``_EmptyStateDictLoadPlanner``), then loads it
    with SafeLoadPlanner's ``weights_only=True`` item loading; reports bytes as tensors land."""

    def __init__(self, include: Include, on_bytes: Callable[[int], None] | None) -> None:
        super().__init__()
        self.include = include
        self.on_bytes = on_bytes
        self.loaded: dict[str, Any] = {}

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        if metadata is None:
            raise CheckpointError("DCP gave the planner no metadata")
        for key, md in metadata.state_dict_metadata.items():
            if not self.include(key):
                continue
            value: Any = md
            if isinstance(md, TensorStorageMetadata):
                value = torch.empty(md.size, dtype=md.properties.dtype)
            path = (metadata.planner_data or {}).get(key)
            if path is not None:
                set_element(state_dict, path, value)
            else:
                state_dict[key] = value
        self.loaded = state_dict
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        if self.on_bytes is not None:
            self.on_bytes(tensor.numel() * tensor.element_size())


class _PreverifiedReader(SafeReader):
    """SafeReader that uses the metadata we already checked instead of reading ``.metadata`` again."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


def load_state(
    layout: Layout,
    step: int,
    metadata: Metadata,
    include: Include = everything,
    on_bytes: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """The nested state dict of a (verified) checkpoint, or the part of it ``include`` selects."""
    planner = _MaterializingPlanner(include, on_bytes)
    try:
        dcp_load({}, storage_reader=_PreverifiedReader(layout.step_path(step), metadata), planner=planner)
    except (CheckpointException, OSError, RuntimeError, ValueError) as e:
        # DCP wraps per-item failures; a refused item (UnsafeCheckpointError) is damage, not a usage error.
        failures = e.failures.values() if isinstance(e, CheckpointException) else []
        for exc, _tb in failures:
            if isinstance(exc, CorruptCheckpointError):
                raise CorruptCheckpointError(step, exc.file, exc.reason) from None
        raise CheckpointError(
            f"step {step}: reading the checkpoint failed: {describe_exception(e)}"
        ) from None
    return planner.loaded
