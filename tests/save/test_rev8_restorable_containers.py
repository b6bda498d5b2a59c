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
    value = (Counter(a=np.int64(3), b=2),)
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
