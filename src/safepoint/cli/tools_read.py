"""Reading a verified checkpoint without a model or a process group: keys, shapes and the whole state.

Nothing here unpickles arbitrary objects: ``.metadata`` goes through the restricted unpickler (after its
bytes are checked against the manifest) and every item through ``weights_only=True``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from safepoint.errors import CheckpointError
from safepoint.state import MODEL, PER_RANK_SECTIONS, SECTIONS, rank_key
from safepoint.store import rank_state
from safepoint.store.guard import as_corruption
from safepoint.store.manifest import Manifest
from safepoint.store.posix_layout import Layout
from safepoint.store.reader import SafeLoadPlanner

Include = Callable[[str], bool]


def everything(_key: str) -> bool:
    return True


def model_only(key: str) -> bool:
    return key.startswith(MODEL + ".")


def read_verified_metadata(layout: Layout, step: int, manifest: Manifest) -> Metadata:
    """DCP metadata of ``step``, checked against the manifest from the very bytes that are unpickled, and
    then structurally (storage paths, offsets, field types: ``guard.load_checked_metadata``)."""
    return layout.read_metadata(step, manifest)


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
    """In-memory size for tensors; serialized size on disk for objects (the size of its ``repr`` for an
    object kept in a rank file, which stores no per-value size)."""


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


def describe_rank_files(layout: Layout, manifest: Manifest) -> list[KeyInfo]:
    """The per-rank sections a checkpoint keeps in rank files (none for a checkpoint that keeps them in
    ``.metadata``, where :func:`describe_keys` finds them), described like ``.metadata``'s keys. Reads
    every rank's file (each checked against the manifest, loaded weights-only): ~20 kB per rank."""
    flat, _ = flatten_state_dict(load_rank_files(layout, manifest, everything))
    out = []
    for key, v in flat.items():
        section = key.split(".", 1)[0]
        if isinstance(v, torch.Tensor):
            out.append(KeyInfo(key, section, "tensor", tuple(v.shape), dtype_name(v.dtype), v.nbytes))
        else:
            out.append(KeyInfo(key, section, "object", None, None, len(repr(v).encode())))
    return out


def _rank_sections(manifest: Manifest) -> list[str]:
    return sorted(s for s in manifest.keys if s in PER_RANK_SECTIONS)


def load_rank_files(layout: Layout, manifest: Manifest, include: Include) -> dict[str, dict[str, Any]]:
    """``{section: {rank_<r>: value}}`` from every rank's file (each checked against the manifest as it is
    read, loaded weights-only), nested as the sections are when ``.metadata`` holds them."""
    out: dict[str, dict[str, Any]] = {}
    if not rank_state.saved_separately(manifest):
        return out
    for r in range(manifest.world_size):
        wanted = [s for s in _rank_sections(manifest) if include(f"{s}.{rank_key(r)}")]
        for s, v in (rank_state.read(layout, manifest, r, wanted) if wanted else {}).items():
            out.setdefault(s, {}).update(v)
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


def load_state(
    layout: Layout,
    step: int,
    metadata: Metadata,
    include: Include = everything,
    on_bytes: Callable[[int], None] | None = None,
    *,
    manifest: Manifest,
) -> dict[str, Any]:
    """The nested state dict of a (verified) checkpoint, or the part of it ``include`` selects; what is
    read is checked against ``manifest`` as it is read."""
    planner = _MaterializingPlanner(include, on_bytes)
    try:
        dcp_load({}, storage_reader=layout.make_reader(step, metadata, manifest), planner=planner)
    except (CheckpointException, OSError, RuntimeError, ValueError, EOFError) as e:
        # Every failure reading a verified checkpoint's bytes is damage (exit 1), not a usage error.
        raise as_corruption(step, e) from None
    for section, ranks in load_rank_files(layout, manifest, include).items():
        planner.loaded.setdefault(section, {}).update(ranks)
    return planner.loaded
