"""Deleting a checkpoint in place (a .pending that is not a real directory): a step-N swapped for a symlink
or another directory between the check and the unlink never makes the delete touch anything else.

The swap is made from inside ``Layout.fence`` (called between the check and the delete): that sequences
the attacker's move at the exact moment, against real files and real symlinks."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import safepoint
from safepoint.errors import CheckpointError
from safepoint.store.manifest import MANIFEST_NAME
from safepoint.store.posix_layout import Layout


def _hostile_root(root: Path, outside: Path) -> None:
    """step-1 and step-2 committed; .pending a symlink to ``outside`` (so deletes happen in place)."""
    with safepoint.CheckpointManager(root) as mgr:
        for step in (1, 2):
            mgr.save(step, safepoint.TrainState(model=torch.nn.Linear(2, 2)))
    os.rmdir(root / ".pending")
    (root / ".pending").symlink_to(outside, target_is_directory=True)


@pytest.mark.parametrize("swap_in", ["symlink", "directory"])
def test_a_step_swapped_before_an_in_place_delete_is_left_alone(tmp_path: Path, swap_in: str) -> None:
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    outside.mkdir()
    (outside / MANIFEST_NAME).write_text("not ROOT's to delete")
    (outside / "precious.txt").write_text("keep me")
    _hostile_root(root, outside)
    layout = Layout(root)
    moved = tmp_path / "moved-step-1"

    def swap(action: str) -> None:
        if moved.exists():  # once: _lost fences again before it reports
            return
        os.rename(root / "step-1", moved)
        if swap_in == "symlink":  # step-1 -> a directory outside ROOT with a file named like a manifest
            (root / "step-1").symlink_to(outside, target_is_directory=True)
        else:  # a new owner's step-1 (another directory): not the one this owner decided to delete
            (root / "step-1").mkdir()
            (root / "step-1" / MANIFEST_NAME).write_text("{}")

    layout.fence = swap  # type: ignore[method-assign]
    error: CheckpointError | None = None
    try:
        layout.remove(1)
    except CheckpointError as e:
        error = e
    assert (outside / MANIFEST_NAME).read_text() == "not ROOT's to delete"
    assert sorted(p.name for p in outside.iterdir()) == sorted([MANIFEST_NAME, "precious.txt"])
    assert re.search(r"not deleting step 1: .*step-1 was replaced meanwhile", str(error)), error
    if swap_in == "symlink":
        assert (root / "step-1").is_symlink()
    else:
        assert (root / "step-1" / MANIFEST_NAME).read_text() == "{}"
    assert (moved / MANIFEST_NAME).is_file()  # the step it meant to delete was never reached either
    assert (root / "step-2" / MANIFEST_NAME).is_file()


def test_an_in_place_delete_still_deletes_the_step(tmp_path: Path) -> None:
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    outside.mkdir()
    _hostile_root(root, outside)
    Layout(root).remove(1)
    assert not (root / "step-1").exists() and (root / "step-2" / MANIFEST_NAME).is_file()
    assert list(outside.iterdir()) == []
