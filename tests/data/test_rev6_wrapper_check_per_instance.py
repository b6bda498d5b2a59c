"""rev6 review of the tensor-subclass fix: ``restorable`` checked a wrapper tensor subclass (torchao's kind)
by the real rule once per *type* and then trusted every later tensor of that type. What restore's
``weights_only`` load refuses depends on the instance, not only its type: its flatten context and
``__dict__`` (torchao: a layout object, inner tensors of other subclasses). A first tensor whose metadata
loads let a second one of the same type whose metadata does not through: a committed checkpoint restore
refuses. Now every wrapper tensor is checked at every save."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import safepoint
from safepoint.errors import SaveError
from tests.helpers.holder import Holder
from tests.helpers.wrapper_tensor import WrapperTensor


class _Opaque:
    """Not plain data: restore's ``torch.load(weights_only=True)`` refuses it."""


class _One(WrapperTensor):
    """One type per test: the check's cache is per type and per process."""


class _Two(WrapperTensor):
    pass


class _Three(WrapperTensor):
    pass


@pytest.fixture(autouse=True)
def _allowed() -> Any:
    with torch.serialization.safe_globals([_One, _Two, _Three]):  # the types are allowed, as torchao's are
        yield


def _restores(root: Path, kind: type[WrapperTensor], step: int) -> None:
    back = safepoint.TrainState(objects={"b": Holder(kind(torch.zeros(3), _Opaque()))}, rng=False)
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(back, step) == step  # committed, so restore must load it


def test_a_second_wrapper_of_a_type_checked_in_the_same_save_is_checked_too(tmp_path: Path) -> None:
    good, bad = Holder(_One(torch.arange(3.0), 1)), Holder(_One(torch.arange(3.0), _Opaque()))
    state = safepoint.TrainState(objects={"a": good, "b": bad}, rng=False)
    try:
        with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
            mgr.save(1, state)
    except SaveError as e:
        assert "objects.b.v" in str(e)  # refused at save time, naming the item: fine
        return
    back = safepoint.TrainState(
        objects={"a": Holder(_One(torch.zeros(3), 1)), "b": Holder(_One(torch.zeros(3), _Opaque()))},
        rng=False,
    )
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.restore(back) == 1  # committed, so restore must load it


def test_a_wrapper_of_a_type_checked_in_an_earlier_save_is_checked_again(tmp_path: Path) -> None:
    obj = Holder(_Two(torch.arange(3.0), 1))
    state = safepoint.TrainState(objects={"b": obj}, rng=False)
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, state)
        obj.v = _Two(torch.arange(3.0), _Opaque())  # the same type, metadata restore refuses
        try:
            mgr.save(2, state)
        except SaveError as e:
            assert "objects.b.v" in str(e)
            return
    _restores(tmp_path / "ckpt", _Two, 2)


def test_the_same_wrapper_alone_is_refused_at_save(tmp_path: Path) -> None:
    """The control: checked first, such a tensor fails the save (what the per-type cache skips later)."""
    state = safepoint.TrainState(objects={"b": Holder(_Three(torch.arange(3.0), _Opaque()))}, rng=False)
    with pytest.raises(SaveError, match=r"objects\.b\.v"):
        with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
            mgr.save(1, state)
