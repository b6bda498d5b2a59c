"""rev5 review of the cheaper guarded walks (store/storage.py ``make_save_dir``'s one walk, the shared
RootDir per root path in store/root_cache.py, retention's delete that asks about ``.pending`` only when the
move into it failed): a ``.pending`` swapped between two saves of one manager for a symlink out of ROOT, a
FIFO or a file is refused (nothing outside written, no hang), a delete through a symlinked ``.pending``
deletes in place and touches nothing outside, and a root path removed and made again is the new one."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import safepoint
from safepoint.store.posix_layout import Layout


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def _state(seed: int) -> safepoint.TrainState:
    torch.manual_seed(seed)
    return safepoint.TrainState(model=torch.nn.Linear(4, 3), rng=False)


@pytest.mark.parametrize("plant", ["symlink", "fifo", "file"])
def test_a_pending_swapped_between_saves_of_one_manager_is_refused(
    root: Path, outside: Path, plant: str
) -> None:
    before = _tree(outside)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with safepoint.CheckpointManager(root) as mgr:
            mgr.save(1, _state(1))
            shutil.rmtree(root / ".pending")
            if plant == "symlink":
                (root / ".pending").symlink_to(outside, target_is_directory=True)
            elif plant == "fifo":
                os.mkfifo(root / ".pending")
            else:
                (root / ".pending").write_text("x")
            with pytest.raises(safepoint.SaveError, match="not a directory"):
                mgr.save(2, _state(2))
    assert _tree(outside) == before
    assert not (root / "step-2").exists()


def test_a_delete_through_a_symlinked_pending_stays_in_root(root: Path, outside: Path) -> None:
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
    shutil.rmtree(root / ".pending")
    (root / ".pending").symlink_to(outside, target_is_directory=True)
    before = _tree(outside)
    Layout(root).remove(1)  # the move into .pending fails (ELOOP): deleted in place
    assert not (root / "step-1").exists() and (root / "step-2").is_dir()
    assert _tree(outside) == before and (root / ".pending").is_symlink()


@pytest.mark.parametrize("again", ["directory", "symlink"])
def test_a_root_removed_and_made_again_between_saves_is_fenced(
    root: Path, tmp_path: Path, outside: Path, again: str
) -> None:
    # The RootDir kept per path (store/root_cache.py) holds no descriptor and no verdict: the next save
    # walks what the path names now, and the lease (gone with the old root) refuses the commit; a root
    # made again as a symlink is the user's path (store/rootfs.py: the root's own path is opened as given),
    # so a refused save may leave its attempt record and .pending there, never overwrite or delete a file.
    elsewhere = tmp_path / "elsewhere"
    before = _tree(outside)
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, _state(1))
        shutil.move(str(root), str(elsewhere))
        if again == "directory":
            root.mkdir()
        else:
            root.symlink_to(outside, target_is_directory=True)
        with pytest.raises(safepoint.SaveError, match="lease"):
            mgr.save(2, _state(2))
    assert not (root / "step-2").exists() and not (elsewhere / "step-2").exists()
    assert (elsewhere / "step-1").is_dir()
    if again == "symlink":
        assert set(before) <= set(_tree(outside)) and (outside / "precious.txt").read_text() == "keep me"
        assert (outside / "sub" / "also.txt").read_text() == "keep me too"
        assert not any(p.startswith("step-") for p in _tree(outside))
