"""``restorable`` checks a dict of flat dicts (an optimizer's per-parameter state) in one C-level pass
(``_dicts_of_leaves``); any child that is not a plain dict of plain tensors and values must still go
through the item-by-item rule: a NumPy scalar converted (in a copy), an item restore would refuse named."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch

from safepoint.data.restorable import restorable
from safepoint.errors import SaveError


class _Opaque:
    """Not plain data: restore's ``torch.load(weights_only=True)`` refuses it."""


def _state(n: int = 50) -> dict[str, Any]:
    per = {f"p{i}": {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4), "k": i} for i in range(n)}
    return {"optimizer": {"state": per, "param_groups": [{"lr": 1e-3, "params": list(per)}]}}


def test_a_dict_of_flat_dicts_is_returned_as_it_is() -> None:
    sd = _state()
    out = restorable(sd)
    assert out is sd
    assert out["optimizer"]["state"] is sd["optimizer"]["state"]


@pytest.mark.parametrize("where", [0, 17, 49])
def test_a_numpy_scalar_in_one_child_is_converted_in_a_copy(where: int) -> None:
    sd = _state()
    live = sd["optimizer"]["state"][f"p{where}"]
    live["beta"] = np.float64(0.25)
    out = restorable(sd)
    child = out["optimizer"]["state"][f"p{where}"]
    assert type(child["beta"]) is float and child["beta"] == 0.25
    assert type(live["beta"]) is np.float64  # the live dict is left as it was
    assert child is not live and child["exp_avg"] is live["exp_avg"]
    others = [k for k in sd["optimizer"]["state"] if k != f"p{where}"]
    assert all(out["optimizer"]["state"][k] is sd["optimizer"]["state"][k] for k in others)


@pytest.mark.parametrize("where", [0, 31, 49])
def test_an_item_restore_would_refuse_in_one_child_fails_the_check_naming_it(where: int) -> None:
    sd = _state()
    sd["optimizer"]["state"][f"p{where}"]["bad"] = _Opaque()
    with pytest.raises(SaveError, match=rf"optimizer\.state\.p{where}\.bad"):
        restorable(sd)


@pytest.mark.parametrize(
    "child",
    [
        {"nested": {"x": _Opaque()}},  # a dict inside the per-parameter dict
        OrderedDict(x=_Opaque()),  # not a plain dict: the item-by-item rule
        [torch.zeros(1), _Opaque()],  # a list among the dicts
    ],
    ids=["nested", "ordereddict", "list"],
)
def test_a_child_that_is_not_a_flat_dict_is_still_checked_item_by_item(child: Any) -> None:
    sd = _state()
    sd["optimizer"]["state"]["p9"] = child
    with pytest.raises(SaveError, match=r"optimizer\.state\.p9"):
        restorable(sd)
