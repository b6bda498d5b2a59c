"""Tensor subclasses (rev6 review; pre-existing on main): ``restorable`` returned every ``torch.Tensor`` as it
was, a subclass too, and a sync save wrote the item with ``torch.save``, pickling the subclass's class,
which restore's ``weights_only`` load then refused (UnsafeCheckpointError): a committed checkpoint found
unrestorable only after the crash it was saved for (an async save restored: its staging copy is a plain
tensor). Now a plain Python subclass is saved as a ``torch.Tensor`` over the same memory and restored into
the live subclass tensor; a wrapper subclass (torchao's NF4/float8 kind) that restore would refuse fails
the save at once, naming the item."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import safepoint
from safepoint.errors import SaveError
from tests.helpers.holder import Holder
from tests.helpers.wrapper_tensor import WrapperTensor


class _Sub(torch.Tensor):
    """A tensor subclass that restore's ``torch.load(weights_only=True)`` does not allow."""


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_tensor_subclass_item_is_refused_at_save_or_restored(tmp_path: Path, async_save: bool) -> None:
    obj = Holder(torch.arange(3.0).as_subclass(_Sub))
    state = safepoint.TrainState(objects={"o": obj}, rng=False)
    try:
        with safepoint.CheckpointManager(tmp_path / "ckpt", async_save=async_save) as mgr:
            mgr.save(1, state)
            mgr.wait()
    except SaveError as e:
        assert "objects.o.v" in str(e)  # refused at save time, naming the item: fine
        return
    back = Holder(torch.zeros(3).as_subclass(_Sub))
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.restore(safepoint.TrainState(objects={"o": back}, rng=False)) == 1
    assert torch.equal(back.v.as_subclass(torch.Tensor), torch.arange(3.0))


def test_a_model_whose_parameter_is_a_tensor_subclass_restores_after_a_sync_save(tmp_path: Path) -> None:
    # A plain Python subclass is saved as a torch.Tensor over the same memory (as an async save's
    # staging copy was), and restore copies the values into the live subclass parameter.
    torch.manual_seed(0)
    lin = torch.nn.Linear(2, 2)
    lin.weight = torch.nn.Parameter(lin.weight.detach().as_subclass(_Sub))
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, safepoint.TrainState(model=lin, rng=False))
    back = torch.nn.Linear(2, 2)
    back.weight = torch.nn.Parameter(torch.zeros(2, 2).as_subclass(_Sub))
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.restore(safepoint.TrainState(model=back, rng=False)) == 1
    assert type(back.weight.data) is _Sub and torch.equal(back.weight.detach(), lin.weight.detach())


def test_a_wrapper_subclass_restore_would_refuse_is_refused_at_save_naming_it(tmp_path: Path) -> None:
    obj = Holder(WrapperTensor(torch.arange(3.0), None))  # its class is not allowlisted
    state = safepoint.TrainState(objects={"o": obj}, rng=False)
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        with pytest.raises(SaveError, match="objects.o.v"):
            mgr.save(1, state)
        assert mgr.list() == []
