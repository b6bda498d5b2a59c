"""A save's own directory is held open while its writer writes into it (store/held_dirs.py): walks into it
start from the held descriptor (the directory the walk from the root reached), a symlink put at its path
meanwhile is never followed, and nothing stays held once DCP's save returned, whether it succeeded or not."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import safepoint
from safepoint.errors import SaveError
from safepoint.store import held_dirs, storage
from safepoint.store.rootfs import RootDir


def test_walks_into_a_held_directory_start_from_it_and_never_from_its_path(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    elsewhere.mkdir()
    fs = RootDir(root)
    fs.make()
    fs.hold(".pending/step-1-x")
    try:
        # The held directory moved aside and a symlink to another directory put at its path: the walk
        # reaches the directory that was held, never the link's target.
        os.rename(root / ".pending" / "step-1-x", root / ".pending" / "moved")
        (root / ".pending" / "step-1-x").symlink_to(elsewhere)
        fs.write(".pending/step-1-x/a", b"x")
        assert (root / ".pending" / "moved" / "a").read_bytes() == b"x"
        assert list(elsewhere.iterdir()) == []
    finally:
        fs.release(".pending/step-1-x")
    with pytest.raises(OSError):  # let go: the walk from the root meets the symlink and refuses it
        fs.write(".pending/step-1-x/b", b"x")
    assert list(elsewhere.iterdir()) == []


def test_at_most_max_held_directories_are_held_the_oldest_let_go_first(tmp_path: Path) -> None:
    fs = RootDir(tmp_path)
    names = [f"d{i}" for i in range(held_dirs.MAX_HELD + 1)]
    try:
        for name in names:
            fs.hold(name)
        held = set(held_dirs._held)
        assert len(held) == held_dirs.MAX_HELD
        assert f"{tmp_path}/d0" not in held and f"{tmp_path}/{names[-1]}" in held
    finally:
        for name in names:
            fs.release(name)
    assert not held_dirs._held


def _state() -> safepoint.TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return safepoint.TrainState(model=model, optimizer=opt)


def test_a_save_writes_through_its_held_directory_and_lets_it_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[int] = []
    real = held_dirs.start

    def start(prefix: str, parts: tuple[str, ...]) -> Any:
        got = real(prefix, parts)
        if got is not None:
            started.append(got[1])
        return got

    monkeypatch.setattr(held_dirs, "start", start)
    state = _state()
    with safepoint.CheckpointManager(tmp_path / "root", keep=safepoint.Keep(last=1)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state)
            assert not held_dirs._held
        # The data files, the fingerprints, the rank file, .metadata and the links of unchanged groups.
        assert len(started) >= 3 * 4 and set(started) == {2}
        before = len(started)

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise OSError("disk on fire")

        monkeypatch.setattr(storage.SafepointWriter, "_write_entries", broken)
        with pytest.raises(SaveError, match="disk on fire"):
            mgr.save(4, state)
        assert not held_dirs._held and len(started) > before
        monkeypatch.undo()
        mgr.save(5, state)
        assert not held_dirs._held
        mgr.wait()
        assert [c.step for c in mgr.list()] == [5]
    assert not list((tmp_path / "root" / ".pending").iterdir())  # the failed save's directory went too
