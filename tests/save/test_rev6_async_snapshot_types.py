"""Container types in an async save's snapshot (rev6 review; pre-existing on main): staging's walk rebuilt
every tuple subclass as a plain ``tuple``, so a ``torch.Size`` (which restore's ``weights_only`` load
allows) was checkpointed and restored as a tuple by an async save and as a ``torch.Size`` by a sync save
of the same state. The snapshot now keeps a tuple's or list's own type (a dict's type DCP never stores:
it stores the keys; except inside a tuple, which it pickles whole: there a dict keeps its type too)."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

import safepoint
from safepoint.save.staging import Stager
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


def test_a_later_write_to_a_dict_attribute_never_reaches_the_snapshot() -> None:
    # A dict inside a tuple is pickled whole, attributes and all (a module's state_dict() is an
    # OrderedDict with a ``_metadata`` attribute): the snapshot's copy must not share them with the live
    # dict, or a write after save() returned reaches the checkpoint the writer is still to write.
    od: Any = OrderedDict(a=torch.ones(2))
    od.meta = {"seen": [1, 2]}
    stager = Stager()
    try:
        snapshot = stager.stage({"t": (od,)})
        od.meta["seen"].append(3)
        od.meta["new"] = True
        got = snapshot["t"][0]
        assert got.meta == {"seen": [1, 2]} and type(got) is OrderedDict
        assert torch.equal(got["a"], torch.ones(2)) and got["a"] is not od["a"]
    finally:
        stager.release()


@pytest.mark.parametrize("mode", ["sync", "thread", "process"])
def test_a_parameter_inside_a_tuple_is_restored_as_a_parameter(tmp_path: Path, mode: str) -> None:
    # A tuple is pickled whole, its tensors' class and requires_grad flag with them: a sync save restores a
    # Parameter as a Parameter (an object that sets it back on a module needs one), and an async save must
    # too, not the plain staging buffer in its place.
    value = (
        torch.nn.Parameter(torch.ones(3)),
        torch.full((2,), 2.0, requires_grad=True),
        {
            "w": torch.nn.Parameter(torch.zeros(2), requires_grad=False),
            "b": [torch.nn.Parameter(torch.ones(1))],
        },
        torch.arange(4.0),
    )
    state = safepoint.TrainState(objects={"o": Holder({"t": value})}, rng=False)
    writer = safepoint.WriterOptions(async_writer="thread" if mode == "sync" else mode)
    with safepoint.CheckpointManager(tmp_path / "ckpt", async_save=mode != "sync", writer=writer) as mgr:
        mgr.save(1, state)
        mgr.wait()
    back = Holder({"t": ()})
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.restore(safepoint.TrainState(objects={"o": back}, rng=False)) == 1
    p, g, d, plain = back.v["t"]
    assert type(p) is torch.nn.Parameter and p.requires_grad and torch.equal(p, torch.ones(3))
    assert type(g) is torch.Tensor and g.requires_grad and torch.equal(g, torch.full((2,), 2.0))
    assert type(d["w"]) is torch.nn.Parameter and not d["w"].requires_grad
    assert type(d["b"][0]) is torch.nn.Parameter and d["b"][0].requires_grad
    assert type(plain) is torch.Tensor and not plain.requires_grad and torch.equal(plain, torch.arange(4.0))
