"""A load plan for the common restore without DCP's resharding machinery.

DCP's ``create_default_local_load_plan`` runs its resharding algorithm for every tensor
(``create_read_items_for_chunk_list``: chunk lists, a sweep over overlaps, three ``torch.Size`` per item):
~0.1 ms an item, a second for a 10,000-item state. When the state being loaded has exactly the checkpoint's
keys and every tensor is a plain tensor stored whole (one chunk at offset 0 of the same size: every
single-process save, and every save whose tensors were not sharded), each tensor is one read of that one
chunk, and the plan can be written down directly. It is the very plan DCP would make (same items, same
order: ``tests/store/test_whole_plan.py`` compares them); anything else returns None and DCP plans.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

_BYTES_AT = torch.Size((0,))  # DCP's offsets and length for a byte item


def whole_item_plan(state_dict: dict[str, Any], metadata: Metadata) -> LoadPlan | None:
    """DCP's local load plan for ``state_dict`` (flattened) if every item is read whole, else None."""
    entries = metadata.state_dict_metadata
    if len(entries) != len(state_dict):
        return None  # missing or extra keys: DCP decides (strictness, pre-2.4 key layouts)
    zeros: dict[int, torch.Size] = {}
    items: list[ReadItem] = []
    for fqn, obj in state_dict.items():
        md = entries.get(fqn)
        if md is None:
            return None
        if isinstance(md, BytesStorageMetadata):
            index = MetadataIndex(fqn)
            items.append(ReadItem(LoadItemType.BYTE_IO, index, _BYTES_AT, index, _BYTES_AT, _BYTES_AT))
            continue
        # A subclass (DTensor, ShardedTensor, a Parameter) may be sharded or behave otherwise: DCP plans.
        if not isinstance(md, TensorStorageMetadata) or type(obj) is not torch.Tensor or len(md.chunks) != 1:
            return None
        chunk = md.chunks[0]
        size = obj.size()
        if md.size != size or chunk.sizes != size or any(chunk.offsets):
            return None
        if 0 in size:
            continue  # an empty tensor: DCP's resharding finds no overlap and plans no read either
        zero = zeros.get(len(size))
        if zero is None:
            zero = zeros[len(size)] = torch.Size([0] * len(size))
        index = MetadataIndex(fqn, zero, 0)
        items.append(ReadItem(LoadItemType.TENSOR, index, zero, index, zero, chunk.sizes))
    return LoadPlan(items)
