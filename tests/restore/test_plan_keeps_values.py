"""The plan path of a restore (``strict=False``, ``ignore``, ``remap``, or any template-free part: a
PlainState, an optimizer without a model) gives back every value of the state, those DCP's flattening does
not see included.

DCP's ``flatten_state_dict`` drops empty containers: an empty dict, and a list holding only empty dicts, have
no leaf. The plan path used to rebuild the state from the flattened keys (``unflatten_state_dict``), so what
flattening dropped vanished from what was loaded, though the full (default) path, which loads into the state
in place, kept it:

- a LambdaLR whose lambda is a ``functools.partial`` (transformers' and torchtitan's warmup schedules) has
  ``lr_lambdas == [{}]`` in its state dict: its ``load_state_dict`` raised ``KeyError: 'lr_lambdas'``;
- a momentum-free SGD's state dict has ``state == {}``: ``set_state_dict`` took the dict for a flattened one
  (``KeyError: 'param_groups.weight.lr'``).

Values that are no empty container (``[None]``, ``[None, 1]``, a LambdaLR of a plain function, whose
``lr_lambdas`` is ``[None]``) came back before and still do; they are checked beside the others.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import safepoint
from safepoint.data.plain import PlainState

EXTRA = {"a": [None], "b": [None, 1]}


def _factor(epoch: int, base: float) -> float:
    return base**epoch


GIVEN: dict[int, dict[str, Any]] = {}  # id(scheduler) -> the state dict its last load was handed


class _Recorded(torch.optim.lr_scheduler.LambdaLR):
    """A LambdaLR that records what the restore hands it (outside itself: its __dict__ is its state)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        GIVEN[id(self)] = dict(state_dict)
        super().load_state_dict(state_dict)


def _job(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: its state is {}
    opt_b = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.2, momentum=0.9)
    return {
        "model": model,
        "opt": opt,
        "partial": _Recorded(opt, functools.partial(_factor, base=0.5)),  # lr_lambdas == [{}]
        "function": _Recorded(opt_b, lambda epoch: 0.9**epoch),  # lr_lambdas == [None]
    }


def _state(job: dict[str, Any], extra: dict[str, Any]) -> safepoint.TrainState:
    return safepoint.TrainState(
        model=job["model"],
        optimizer=job["opt"],
        scheduler=job["partial"],
        objects={"function": job["function"]},
        extra=extra,
        rng=False,
    )


@pytest.mark.parametrize(
    "how",
    [
        pytest.param({"template_free": True}, id="template-free"),
        pytest.param({"strict": False}, id="strict-false"),
        pytest.param({"ignore": ["extra.absent"]}, id="ignore"),
    ],
)
def test_the_plan_path_gives_back_empty_containers_and_none_lists(root: Path, how: dict[str, Any]) -> None:
    saved = _job(0)
    saved["model"](torch.ones(1, 3)).sum().backward()
    saved["opt"].step()
    for sched in (saved["partial"], saved["function"]):
        sched.step()
        sched.step()
    assert saved["partial"].state_dict()["lr_lambdas"] == [{}]
    assert saved["function"].state_dict()["lr_lambdas"] == [None]
    assert saved["opt"].state_dict()["state"] == {}
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(3, _state(saved, {**EXTRA, "plain": PlainState(dict(EXTRA))}))

    fresh = _job(1)
    plain = PlainState()
    extra: dict[str, Any] = {"a": 0, "b": 0, "plain": plain}
    options = {k: v for k, v in how.items() if k != "template_free"}
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(_state(fresh, extra), **options) == 3

    assert extra["a"] == [None] and extra["b"] == [None, 1]
    assert plain.value == EXTRA
    for name in ("partial", "function"):
        given = GIVEN.pop(id(fresh[name]), None)
        assert given is not None and given["lr_lambdas"] == saved[name].state_dict()["lr_lambdas"], name
        assert fresh[name].state_dict() == saved[name].state_dict(), name
    assert fresh["opt"].state_dict() == saved["opt"].state_dict()
    pairs = zip(fresh["model"].parameters(), saved["model"].parameters(), strict=True)
    assert all(torch.equal(p, q) for p, q in pairs)


class _IntKeyed:
    """A Stateful whose state dict is keyed by ints, a tensor and plain values among them."""

    def __init__(self, v: float) -> None:
        self.d: dict[Any, Any] = {0: torch.tensor([v]), 1: v, "nested": {2: v}}

    def state_dict(self) -> dict[str, Any]:
        return {"d": self.d}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.d = sd["d"]


@pytest.mark.parametrize("how", [{}, {"strict": False}, {"ignore": ["nothing.*"]}])
def test_int_keyed_values_load_at_their_own_keys(root: Path, how: dict[str, Any]) -> None:
    # Review round 5: DCP's object paths name every dict key str(key), and its set_element wrote the loaded
    # value beside an int key (at "1"), so the object kept its stale value at 1 (default path, .metadata);
    # the plan path's put_back did the same for extra's {3: ...} (before it, the keys came back as strings).
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, safepoint.TrainState(objects={"o": _IntKeyed(1.0)}, extra={"e": {3: 4}}, rng=False))
        into = _IntKeyed(2.0)
        state = safepoint.TrainState(objects={"o": into}, extra={"e": {3: 0}}, rng=False)
        mgr.restore(state, **how)
    assert list(into.d) == [0, 1, "nested"] and into.d[1] == 1.0 and into.d["nested"] == {2: 1.0}
    assert torch.equal(into.d[0], torch.tensor([1.0]))
    assert state.extra == {"e": {3: 4}}


def test_int_keys_are_found_without_a_scan_per_value() -> None:
    from safepoint.data.own_keys import set_at

    class _Keys(dict[Any, Any]):
        """Counts iterations over its keys (a scan)."""

        scans = 0

        def __iter__(self) -> Any:
            _Keys.scans += 1
            return super().__iter__()

    state = _Keys({i: {"step": 0} for i in range(1000)})
    root: dict[str, Any] = {"state": state}
    for i in range(1000):
        set_at(root, ("state", str(i), "step"), i)
    assert [state[i]["step"] for i in range(1000)] == list(range(1000)) and list(state) == list(range(1000))
    assert _Keys.scans == 1  # the check's own list(state) above: none per value
