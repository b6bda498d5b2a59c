"""A path (or ``file://``) durable root is served by fsspec's local file system, which follows symlinks: a
``step-N``, ``.pending`` or ``.run`` planted below the root as a symlink had the save write the checkpoint
(or the run journal) into its target, outside the root, and retention delete the target's files. Every
write and delete of such a root now walks its directories (store/rootfs.py, ``ObjectStore.guard``), as the
local tier always did: nothing outside the root is written or deleted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import safepoint
from safepoint.remote.open import open_store
from safepoint.remote.retry import UploadError


def _outside(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"not safepoint's")
    return outside


@pytest.mark.parametrize("name", ["step-2", ".run"])
def test_a_planted_symlink_below_a_path_durable_root_is_never_written_through(
    tmp_path: Path, name: str
) -> None:
    durable, outside = tmp_path / "durable", _outside(tmp_path)
    durable.mkdir()
    (durable / name).symlink_to(outside, target_is_directory=True)
    state = safepoint.TrainState(model=torch.nn.Linear(8, 8), rng=False)
    with safepoint.CheckpointManager(durable, local_root=tmp_path / "local") as mgr:
        for step in (1, 2, 3):
            try:
                mgr.save(step, state)
                mgr.wait()
            except safepoint.CheckpointError as e:
                assert step == 2 and name == "step-2", e  # its upload refused, one line, nothing committed
                assert "\n" not in str(e)
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]
    assert (outside / "victim").read_bytes() == b"not safepoint's"
    with safepoint.CheckpointManager(durable) as mgr:
        assert 3 in [c.step for c in mgr.list()]


def test_the_store_never_deletes_or_copies_through_a_planted_symlink(tmp_path: Path) -> None:
    # What retention and an incremental save ask of the store: delete a step's objects, copy an unchanged
    # one into the next step. Through a step that is a symlink, both reached the target's files.
    durable, outside = tmp_path / "durable", _outside(tmp_path)
    (durable / "step-1").mkdir(parents=True)
    (durable / "step-1" / "a.distcp").write_bytes(b"data")
    (durable / "step-2").symlink_to(outside, target_is_directory=True)
    store, base = open_store(str(durable), None, None)
    store.delete([f"{base}/step-2/victim"])
    with pytest.raises(UploadError):
        store.copy(f"{base}/step-1/a.distcp", f"{base}/step-2/a.distcp")
    with pytest.raises(UploadError):
        store.put_bytes(f"{base}/step-2/safepoint.json", b"{}")
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]
    assert (durable / "step-1" / "a.distcp").read_bytes() == b"data"
