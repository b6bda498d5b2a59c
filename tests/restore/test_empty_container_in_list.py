"""A list DCP walks item by item (it holds a dict) with an empty dict or list in it: ``{"a": [0, {}]}``.

DCP's save planner flattens the state, then its ShardedTensors; its load planner does it the other way
round, and flattening ShardedTensors first rebuilds the state from its leaves, dropping the empty ``{}``:
the load then asks for ``a`` where the save wrote ``a.0`` ("Missing key in checkpoint state_dict: a.").
Plain ``dcp.save``/``dcp.load`` fail so (torch 2.13); a safepoint save committed such a checkpoint, which
no restore could load (found by tests/save/test_async_differential.py's campaign). Restore's planner now
flattens in the save's order (store/reader.py ``SafeLoadPlanner.set_up_planner``)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import safepoint
from tests.helpers.holder import Holder

STATES = {
    "int and empty dict": [0, {}],
    "tensor and empty dict": [torch.arange(3.0), {}],
    "nested": {"a": [1, {"b": [2, {}], "c": {}}], "d": [[], {"e": 3}]},
    "empty list beside a dict": [[], {"x": 1}, "s"],
}


def _blank(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return torch.zeros_like(v)
    if isinstance(v, dict):
        return {k: _blank(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_blank(x) for x in v]
    return copy.deepcopy(v) if not isinstance(v, (int, str)) else type(v)()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", list(STATES))
def test_a_list_with_an_empty_container_restores(tmp_path: Path, name: str, async_save: bool) -> None:
    value = STATES[name]
    with safepoint.CheckpointManager(tmp_path / "ckpt", async_save=async_save) as mgr:
        mgr.save(1, safepoint.TrainState(objects={"o": Holder(value)}, rng=False))
    back = Holder(_blank(value))
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.restore(safepoint.TrainState(objects={"o": back}, rng=False)) == 1
    assert _same(back.v, value), back.v
