"""The directly written load plan (store/whole_plan.py) is DCP's own plan, or None where DCP must plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict

from safepoint.store.reader import SafeLoadPlanner, SafeReader
from safepoint.store.storage import SafepointWriter
from safepoint.store.whole_plan import whole_item_plan


def _state() -> dict[str, Any]:
    model = nn.Sequential(nn.Linear(5, 3), nn.LayerNorm(3), nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    m, o = get_state_dict(model, opt)
    extra = {"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "ints": torch.arange(6), "n": 7}
    return {"model": m, "optim": o, "extra": extra}


def _saved(tmp_path: Path) -> Metadata:
    dcp.save(_state(), storage_writer=SafepointWriter(tmp_path), no_dist=True)
    return SafeReader(tmp_path).read_metadata()


def test_the_plan_is_dcps_item_for_item(tmp_path: Path) -> None:
    metadata = _saved(tmp_path)
    flat, _ = flatten_state_dict(_state())
    ours = whole_item_plan(flat, metadata)
    assert ours is not None
    theirs = create_default_local_load_plan(flat, metadata, True)
    assert ours.items == theirs.items


@pytest.mark.parametrize("change", ["missing", "extra", "resized", "parameter"])
def test_anything_else_is_left_to_dcp(tmp_path: Path, change: str) -> None:
    metadata = _saved(tmp_path)
    flat, _ = flatten_state_dict(_state())
    key = "model.0.weight"
    if change == "missing":
        del flat[key]
    elif change == "extra":
        flat["model.new"] = torch.zeros(2)
    elif change == "resized":
        flat[key] = torch.zeros(4, 4)
    else:
        flat[key] = nn.Parameter(flat[key])
    assert whole_item_plan(flat, metadata) is None


def test_a_tensor_saved_in_chunks_is_left_to_dcp(tmp_path: Path) -> None:
    metadata = _saved(tmp_path)
    flat, _ = flatten_state_dict(_state())
    md = metadata.state_dict_metadata["model.0.weight"]
    assert isinstance(md, TensorStorageMetadata)
    halves = [
        ChunkStorageMetadata(offsets=torch.Size((0, 0)), sizes=torch.Size((2, 5))),
        ChunkStorageMetadata(offsets=torch.Size((2, 0)), sizes=torch.Size((1, 5))),
    ]
    metadata.state_dict_metadata["model.0.weight"] = TensorStorageMetadata(md.properties, md.size, halves)
    assert whole_item_plan(flat, metadata) is None


def test_a_restore_through_the_planner_uses_the_direct_plan_and_loads_bitwise(tmp_path: Path) -> None:
    src = _state()
    dcp.save(src, storage_writer=SafepointWriter(tmp_path), no_dist=True)
    dst = _state()
    for t in flatten_state_dict(dst)[0].values():
        if isinstance(t, torch.Tensor):
            t.zero_()
    planner = SafeLoadPlanner()
    dcp.load(dst, storage_reader=SafeReader(tmp_path), planner=planner, no_dist=True)
    assert planner.whole_items
    for key, t in flatten_state_dict(src)[0].items():
        got = flatten_state_dict(dst)[0][key]
        assert torch.equal(got, t) if isinstance(t, torch.Tensor) else got == t, key
