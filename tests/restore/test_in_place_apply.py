"""A restore whose tensors were read into the live parameters skips ``load_state_dict`` (restore/in_place.py)
and plans without DCP's resharding pass (store/whole_plan.py); everything else still goes DCP's way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import safepoint
from safepoint.store import reader
from tests.helpers.train import Setup, assert_bitwise_equal


def _spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[object]]:
    """Record the root modules ``load_state_dict`` runs on and the plans written directly."""
    seen: dict[str, list[object]] = {"loaded": [], "direct": []}
    real_load = nn.Module.load_state_dict
    real_plan = reader.whole_item_plan

    def load(self: nn.Module, *args: object, **kw: object) -> object:
        seen["loaded"].append(self)
        return real_load(self, *args, **kw)  # type: ignore[arg-type]

    def plan(*args: object) -> object:
        got = real_plan(*args)  # type: ignore[arg-type]
        seen["direct"].append(got is not None)
        return got

    monkeypatch.setattr(nn.Module, "load_state_dict", load)
    monkeypatch.setattr(reader, "whole_item_plan", plan)
    return seen


def test_live_tensors_read_in_place_skip_load_state_dict(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = Setup()
    s.step()
    expected = s.snapshot()
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, s.state())
        s.step()
        after = s.step()
        seen = _spy(monkeypatch)
        s2 = Setup(seed=5)
        assert mgr.restore(s2.state()) == 1
    assert_bitwise_equal(expected, s2.snapshot())
    assert seen["direct"] == [True]
    assert s2.model not in seen["loaded"]
    # The optimizer was still loaded (its hyperparameters and state), and training goes on identically.
    s2.step()
    assert s2.step() == after


def test_load_hooks_still_run(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = Setup()
    s.step()
    expected = s.snapshot()
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, s.state())
        seen = _spy(monkeypatch)
        s2 = Setup(seed=5)
        calls: list[str] = []
        s2.model.net[0].register_load_state_dict_pre_hook(lambda module, sd, prefix, *a: calls.append(prefix))
        assert mgr.restore(s2.state()) == 1
    assert_bitwise_equal(expected, s2.snapshot())
    assert calls == ["net.0."] and s2.model in seen["loaded"]


class _WithNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)  # overrides _load_from_state_dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


def test_a_module_with_its_own_loading_goes_through_load_state_dict(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = _WithNorm()
    model(torch.randn(8, 4))  # running statistics
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, safepoint.TrainState(model=model))
        seen = _spy(monkeypatch)
        other = _WithNorm()
        assert mgr.restore(safepoint.TrainState(model=other)) == 1
    assert other in seen["loaded"]
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key


def test_another_dtype_is_converted_into_the_live_tensors(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    saved = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3)).double()
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, safepoint.TrainState(model=saved))
        seen = _spy(monkeypatch)
        live = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
        assert mgr.restore(safepoint.TrainState(model=live)) == 1
    for key, value in saved.state_dict().items():
        got = live.state_dict()[key]
        assert got.dtype == torch.float32 and torch.equal(got, value.float()), key
    assert seen["direct"] == [True] and live not in seen["loaded"]


def test_a_partial_restore_still_loads_what_it_selects(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = Setup()
    s.model.extra_head = nn.Linear(2, 2)  # saved, but not in the state restored into
    s.step()
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, safepoint.TrainState(model=s.model, rng=False))
        seen = _spy(monkeypatch)
        s2 = Setup(seed=5)
        assert mgr.restore(safepoint.TrainState(model=s2.model, rng=False), strict=False) == 1
    got = s2.model.state_dict()
    for key, value in s.model.state_dict().items():
        if not key.startswith("extra_head."):
            assert torch.equal(got[key], value), key
    assert seen["direct"] == [False]  # the checkpoint holds more keys: DCP plans
