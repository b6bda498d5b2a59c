"""Directories held open for one save's walks (store/held_dirs.py): a save opens its root by path a few
times, not once per file; a held directory keeps walks on the real directory even when a name on its way
is swapped for a symlink; nothing stays open after the block; outside it, walks are as before."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import safepoint
from safepoint.store.held_dirs import current, holding
from safepoint.store.rootfs import RootDir


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_steady_save_opens_its_root_by_path_a_few_times_not_per_file(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = safepoint.TrainState(model=model, optimizer=opt)
    opened: list[str] = []
    real_open = os.open

    def counting(path: Any, *args: Any, **kwargs: Any) -> int:
        if kwargs.get("dir_fd") is None and os.fspath(path) == str(root):
            opened.append(os.fspath(path))
        return real_open(path, *args, **kwargs)

    with safepoint.CheckpointManager(
        root, keep=safepoint.Keep(last=1), cluster=safepoint.ClusterOptions(background_deletes=False)
    ) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        monkeypatch.setattr(os, "open", counting)
        before = _fds()
        mgr.save(3, state)  # its files, the link of the unchanged group, the commit, step 2's delete
        monkeypatch.setattr(os, "open", real_open)
        assert _fds() <= before  # every held descriptor closed
    # Before: ~20 walks from the root, each opening it by path; now the save, its commit and its
    # retention pass each open it once, and the rest starts from a held descriptor.
    assert 1 <= len(opened) <= 6, len(opened)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-3"]


def test_a_held_directory_is_the_one_walked_to_even_after_a_swap(root: Path, tmp_path: Path) -> None:
    (root / ".pending" / "save").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "save").mkdir(parents=True)
    fs = RootDir(root)
    before = _fds()
    with holding(root, root / ".pending", root / ".pending" / "save"):
        fs.write(".pending/save/a", b"1")  # the first walk: each held directory is kept
        held = current()
        assert held is not None and all(fd >= 0 for fd in held.values())
        # An attacker swaps .pending for a symlink out of the root: held walks stay on the real one.
        os.rename(root / ".pending", root / ".real-pending")
        os.symlink(elsewhere, root / ".pending")
        fs.write(".pending/save/b", b"2")
        assert fs.lstat(".pending/save/b") is not None
    assert current() is None
    assert _fds() <= before
    assert sorted(os.listdir(root / ".real-pending" / "save")) == ["a", "b"]
    assert os.listdir(elsewhere / "save") == []
    # Outside the block the symlink is refused, as ever.
    with pytest.raises(OSError):
        fs.write(".pending/save/c", b"3")
    assert os.listdir(elsewhere / "save") == []


def test_nested_holds_and_missing_directories(root: Path) -> None:
    root.mkdir()
    fs = RootDir(root)
    before = _fds()
    fs.makedirs("sub")
    with holding(root / "sub"):
        with holding(root):
            fs.write("sub/x", b"")  # reaches the outer block's "sub" first: this block opened it, closes it
        outer = current()
        assert outer is not None and outer[str(root / "sub")] < 0
    assert _fds() <= before
    with holding(root / "missing"):
        with pytest.raises(FileNotFoundError):
            fs.write("missing/x", b"")  # never reached: nothing held, the walk fails as before
        with holding(root):
            fs.write("x", b"1")
            inner = current()
            assert inner is not None and inner[str(root)] >= 0
        outer = current()
        assert outer is not None and str(root) not in outer  # the inner block's, closed with it
    assert fs.read("x", 10) == b"1"


def test_a_directory_opened_by_its_own_path_is_never_held_for_the_root(root: Path, tmp_path: Path) -> None:
    """A RootDir made on a path under a held root (``around``, ``read_metadata_file``: a step or pending
    directory named by the caller) opens that path as given, following a symlink: what it reaches must never
    become the held directory that the root's own walks start from (they refuse that symlink)."""
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "save").mkdir(parents=True)
    os.symlink(elsewhere, root / ".pending")  # planted: .pending is a link out of the root
    fs = RootDir(root)
    before = _fds()
    with holding(root, root / ".pending", root / ".pending" / "save"):
        with RootDir(root / ".pending").dir("save"):  # its own path followed, as outside a hold
            pass
        with RootDir(root / ".pending" / "save").dir(""):
            pass
        for rel in (".pending/save/f", ".pending/g"):
            with pytest.raises(OSError):  # ELOOP: the root's walk meets the symlink, as outside a hold
                fs.write(rel, b"x")
    assert _fds() <= before
    assert os.listdir(elsewhere / "save") == [] and sorted(os.listdir(elsewhere)) == ["save"]
