"""The per-rank sections of one load, read from the saved rank's own file (store/rank_state.py).

DCP loads everything else. The file's keys are described to the checks (compat's strict check, the
partial-restore plan) as if ``.metadata`` held them, so a missing, unexpected or mismatched key in
``extra`` or the data position reads exactly as before; the values come from the file, not from DCP.
A checkpoint that keeps these sections inside ``.metadata`` (written before rank files) has ``own``
empty: everything goes through DCP as it did.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from safepoint.state import PER_RANK_SECTIONS
from safepoint.store import rank_state
from safepoint.store.manifest import Manifest
from safepoint.store.posix_layout import CheckpointStore


class RankSections:
    def __init__(self, layout: CheckpointStore, manifest: Manifest, sections: list[str], source: int) -> None:
        self.layout, self.manifest, self.source = layout, manifest, source
        separate = rank_state.saved_separately(manifest)
        self.own = [s for s in sections if s in PER_RANK_SECTIONS] if separate else []
        self._prefixes = tuple(f"{s}." for s in self.own)
        self.values: dict[str, Any] = {}  # {section: {rank_<source>: value}}, once read
        self._flat: dict[str, Any] = {}

    def dcp_part(self, template: dict[str, Any]) -> dict[str, Any]:
        """``template`` without the sections that come from the rank file."""
        return {k: v for k, v in template.items() if k not in self.own}

    def read(self, metadata: Metadata) -> Metadata:
        """Read the rank file; ``metadata`` plus entries for its keys (for the checks; never for DCP)."""
        if not self.own:
            return metadata
        self.values = rank_state.read(self.layout, self.manifest, self.source, self.own)
        self._flat, _ = flatten_state_dict(self.values)
        entries: dict[str, Any] = {}
        for key, value in self._flat.items():
            if isinstance(value, torch.Tensor):
                props = TensorProperties.create_from_tensor(value)
                entries[key] = TensorStorageMetadata(properties=props, size=value.size(), chunks=[])
            else:
                entries[key] = BytesStorageMetadata()
        return dataclasses.replace(metadata, state_dict_metadata={**metadata.state_dict_metadata, **entries})

    def filled(self, template: dict[str, Any]) -> dict[str, Any]:
        """The DCP-loaded ``template`` with the rank file's sections (a full, strict load)."""
        return {**template, **self.values}

    def split(self, to_load: dict[str, Any]) -> dict[str, Any]:
        """Of a partial plan's ``to_load`` (saved key -> target): fill the rank file's keys in place with
        the file's values and return the rest, which DCP loads."""
        for key in to_load:
            if key.startswith(self._prefixes):
                to_load[key] = self._flat[key]
        return {k: v for k, v in to_load.items() if not k.startswith(self._prefixes)}
