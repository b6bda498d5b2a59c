"""Container types in an async save's snapshot (rev6 review; pre-existing on main): staging's walk rebuilt
every tuple subclass as a plain ``tuple``, so a ``torch.Size`` (which restore's ``weights_only`` load
allows) was checkpointed and restored as a tuple by an async save and as a ``torch.Size`` by a sync save
of the same state. The snapshot now keeps a tuple's or list's own type (a dict's type DCP never stores:
it stores the keys)."""

from __future__ import annotations

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
