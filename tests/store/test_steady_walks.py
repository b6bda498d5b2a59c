"""What a steady save of a small state does once, not per call (issue 27, round 14 of docs/benchmarks.md):
its pending directory made by the one guarded walk (no look at ``.pending`` and no ``makedirs`` of the
root's own path while that walk succeeds, both still there to say why it failed or to make a root removed
meanwhile); one RootDir per root reused by the commit protocol's functions (store/root_cache.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import safepoint
from safepoint.store import root_cache
from safepoint.store.rootfs import RootDir
from safepoint.store.storage import _ChecksummingFileSystem


def _state() -> safepoint.TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return safepoint.TrainState(model=model, optimizer=opt)


def _manager(root: Path) -> safepoint.CheckpointManager:
    return safepoint.CheckpointManager(
        root, keep=safepoint.Keep(last=1), cluster=safepoint.ClusterOptions(background_deletes=False)
    )


def test_a_steady_save_makes_its_directory_in_one_walk(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither the save's directory nor retention's delete (inline here) looks at .pending apart from the
    walk that uses it; the root's own path is not made again."""
    state = _state()
    made: list[str] = []
    looked: list[str] = []
    real_makedirs, real_lstat = os.makedirs, RootDir.lstat

    def makedirs(path: Any, *args: Any, **kwargs: Any) -> None:
        made.append(os.fspath(path))
        real_makedirs(path, *args, **kwargs)

    def lstat(self: RootDir, rel: Any) -> os.stat_result | None:  # kind() and isdir() ask through it
        looked.append(os.fspath(rel))
        return real_lstat(self, rel)

    with _manager(root) as mgr:
        mgr.save(1, state)
        monkeypatch.setattr(os, "makedirs", makedirs)
        monkeypatch.setattr(RootDir, "lstat", lstat)
        mgr.save(2, state)
        mgr.save(3, state)
        monkeypatch.undo()
    assert made == [] and not any(p.endswith(".pending") for p in looked), (made, looked)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-3"]


def test_a_root_removed_between_saves_is_made_again(root: Path) -> None:
    state = _state()
    with _manager(root) as mgr:
        mgr.save(1, state)
        # A node that lost its disk: the root's steps and .pending are gone (the lease with them, so the
        # save is refused by the fence; the directory is still made, as DCP's mkdir did).
        for entry in root.iterdir():
            if entry.is_dir():
                shutil.rmtree(entry)
        fs = _ChecksummingFileSystem(None, RootDir(root))  # type: ignore[arg-type]
        fs.make_save_dir(root / ".pending" / "step-2-abc")
        assert (root / ".pending" / "step-2-abc").is_dir()
        shutil.rmtree(root)
        fs.make_save_dir(root / ".pending" / "step-2-abc")
        assert (root / ".pending" / "step-2-abc").is_dir()


@pytest.mark.parametrize("planted", ["symlink", "file"])
def test_a_pending_that_is_not_a_directory_is_named_and_nothing_is_made(
    root: Path, tmp_path: Path, planted: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root.mkdir()
    if planted == "symlink":
        (root / ".pending").symlink_to(outside, target_is_directory=True)
    else:
        (root / ".pending").write_bytes(b"x")
    fs = _ChecksummingFileSystem(None, RootDir(root))  # type: ignore[arg-type]
    with pytest.raises(OSError, match=r"\.pending is a (symlink|regular file), not a directory"):
        fs.make_save_dir(root / ".pending" / "step-2-abc")
    assert list(outside.iterdir()) == []


def test_one_root_dir_per_root_serves_the_commit_protocol(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state()
    made: list[str] = []
    real_init = RootDir.__init__

    def init(self: RootDir, path: Any) -> None:
        made.append(os.fspath(path))
        real_init(self, path)

    with _manager(root) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        monkeypatch.setattr(RootDir, "__init__", init)
        mgr.save(3, state)  # its links, its commit, step 2's identity check and delete
        monkeypatch.undo()
    assert made == [], made
    assert root_cache.root_dir(root) is root_cache.root_dir(str(root))
    relative = root_cache.root_dir("ckpt-relative")
    assert relative is not root_cache.root_dir("ckpt-relative")  # resolved against the cwd of each call


def test_a_read_builds_its_full_path_only_for_a_refusal(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root.mkdir()
    (root / "sub").mkdir()
    (root / "sub" / "file").write_bytes(b"x")
    os.mkfifo(root / "sub" / "fifo")
    fs = RootDir(root)
    full: list[Any] = []
    real_full = RootDir.full

    def counted(self: RootDir, rel: Any) -> Path:
        full.append(rel)
        return real_full(self, rel)

    monkeypatch.setattr(RootDir, "full", counted)
    os.close(fs.open_read("sub/file"))
    assert full == []
    with pytest.raises(OSError, match=rf"{root}/sub/fifo is a FIFO, not a regular file"):
        fs.open_read(Path(root / "sub" / "fifo"))
    assert len(full) == 1
