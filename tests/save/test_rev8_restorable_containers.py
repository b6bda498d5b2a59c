"""What ``restorable`` (data/restorable.py) passes for a container a save stores whole must come back from a
restore as it was, in a sync save and an async one alike (rev8 review).

A dict rebuilt around a converted value (a NumPy scalar made a Python number) was rebuilt as
``type(d)(zip(keys, values))``: a ``Counter`` counts those pairs instead (``Counter({('a', 3): 1})``), a
``defaultdict`` takes them for its factory (TypeError, the save failed with a raw exception)."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import safepoint
from tests.helpers.holder import Holder


def _save_and_restore(root: Path, value: Any, template: Any, async_save: bool) -> Any:
    state = safepoint.TrainState(objects={"o": Holder({"t": value})}, rng=False)
    with safepoint.CheckpointManager(root, async_save=async_save) as mgr:
        mgr.save(1, state)
        mgr.wait()
    back = Holder({"t": template})
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(objects={"o": back}, rng=False)) == 1
    return back.v["t"]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_counter_holding_a_numpy_count_comes_back_as_it_was(tmp_path: Path, async_save: bool) -> None:
    # Inside a tuple DCP pickles the Counter whole, its type and its counts (a Counter is one of the three
    # dict types restore's weights_only load rebuilds).
    value: Any = (Counter({"a": np.int64(3), "b": 2}),)
    got = _save_and_restore(tmp_path / "ckpt", value, (), async_save)
    assert type(got[0]) is Counter and got[0] == Counter(a=3, b=2)
    assert type(value[0]["a"]) is np.int64  # the live state is never changed


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_defaultdict_holding_a_numpy_scalar_is_saved(tmp_path: Path, async_save: bool) -> None:
    # Outside a tuple DCP stores a dict's keys, never its type: restore loads the values into the target's
    # dict. The type must still be one restore can load (allowed here, as a user would allow it).
    value = defaultdict(list, lr=np.float64(0.5), betas=[0.9, 0.99])
    with torch.serialization.safe_globals([defaultdict]):
        got = _save_and_restore(tmp_path / "ckpt", value, {"lr": 0.0, "betas": [0.0, 0.0]}, async_save)
    assert got == {"lr": 0.5, "betas": [0.9, 0.99]} and type(got["lr"]) is float


class Logged(dict[str, Any]):
    """A dict subclass that keeps a log of the keys set (a ``__setitem__`` hook), allowed by the user."""

    def __init__(self, **items: Any) -> None:
        super().__init__()
        self.log: list[str] = []
        for k, v in items.items():
            self[k] = v

    def __setitem__(self, k: str, v: Any) -> None:
        self.log.append(k)
        super().__setitem__(k, v)


class Tags(list[Any]):
    """A list subclass, allowed by the user."""


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("case", ["defaultdict-in-tuple", "hooked-dict-in-tuple", "list-of-strings"])
def test_a_container_restore_cannot_refill_fails_the_save(
    tmp_path: Path, async_save: bool, case: str
) -> None:
    # Restore's weights_only load fills only a dict, OrderedDict or Counter (SETITEM) and only a list
    # (APPEND), whatever the allowed types: a dict subclass inside a tuple, or a list subclass of plain
    # values (DCP pickles either whole), is a checkpoint restore refuses. Its empty shell loads, so the
    # save-time check passed and the save committed it: the save must fail at once, naming it.
    value: Any = {
        "defaultdict-in-tuple": (defaultdict(list, a=[1]),),
        "hooked-dict-in-tuple": (Logged(a=1, b=2),),
        "list-of-strings": Tags(["x", "y"]),
    }[case]
    state = safepoint.TrainState(objects={"o": Holder({"t": value})}, rng=False)
    with (
        torch.serialization.safe_globals([defaultdict, list, Logged, Tags]),
        safepoint.CheckpointManager(tmp_path / "ckpt", async_save=async_save) as mgr,
    ):
        with pytest.raises(safepoint.SaveError, match="objects.o.v.t"):
            mgr.save(1, state)
        mgr.wait()
        assert mgr.latest_step() is None
    if case == "hooked-dict-in-tuple":
        assert value[0].log == ["a", "b"]  # the save never called the live object's hook


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_list_subclass_of_tensors_is_stored_item_by_item_and_restores(
    tmp_path: Path, async_save: bool
) -> None:
    # DCP walks a list holding a tensor (each item stored on its own, the list's type never): restore loads
    # it whatever its type, so the save-time check must not refuse it.
    value = Tags([torch.arange(3.0), torch.ones(2)])
    with torch.serialization.safe_globals([Tags]):
        got = _save_and_restore(tmp_path / "ckpt", value, Tags([torch.zeros(3), torch.zeros(2)]), async_save)
    assert torch.equal(got[0], torch.arange(3.0)) and torch.equal(got[1], torch.ones(2))
