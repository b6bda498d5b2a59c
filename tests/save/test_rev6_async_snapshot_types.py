"""Container types in an async save's snapshot (rev6 review; pre-existing on main): staging's walk rebuilt
every tuple subclass as a plain ``tuple``, so a ``torch.Size`` (which restore's ``weights_only`` load
allows) was checkpointed and restored as a tuple by an async save and as a ``torch.Size`` by a sync save
of the same state. The snapshot now keeps a tuple's or list's own type (a dict's type DCP never stores:
it stores the keys; except inside a tuple, which it pickles whole: there a dict keeps its type too)."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import safepoint
from tests.helpers.holder import Holder


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_torch_size_is_restored_as_a_torch_size(tmp_path: Path, async_save: bool) -> None:
    state = safepoint.TrainState(objects={"o": Holder({"shape": torch.Size([2, 3])})}, rng=False)
    with safepoint.CheckpointManager(tmp_path / "ckpt", async_save=async_save) as mgr:
        mgr.save(1, state)
        mgr.wait()
    back = Holder({"shape": torch.Size([0])})
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.restore(safepoint.TrainState(objects={"o": back}, rng=False)) == 1
    assert type(back.v["shape"]) is torch.Size and back.v["shape"] == torch.Size([2, 3])


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_dict_subclass_inside_a_tuple_keeps_its_type(tmp_path: Path, async_save: bool) -> None:
    # DCP stores a tuple whole (one pickled value), so the type of a dict inside it is part of what is
    # saved: an async save's snapshot rebuilt it as a plain dict, where a sync save kept the OrderedDict.
    value = (OrderedDict(b=1, a=2), [OrderedDict(c={"d": OrderedDict(e=3)})])
    state = safepoint.TrainState(objects={"o": Holder({"t": value})}, rng=False)
    with safepoint.CheckpointManager(tmp_path / "ckpt", async_save=async_save) as mgr:
        mgr.save(1, state)
        mgr.wait()
    back = Holder({"t": ()})
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.restore(safepoint.TrainState(objects={"o": back}, rng=False)) == 1
    got = back.v["t"]
    assert got == value
    assert type(got[0]) is OrderedDict and list(got[0]) == ["b", "a"]
    assert type(got[1][0]) is OrderedDict and type(got[1][0]["c"]["d"]) is OrderedDict
