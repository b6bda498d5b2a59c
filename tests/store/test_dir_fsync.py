"""A file system without directory fsync (CIFS/SMB, some FUSE mounts: EINVAL) is said once, not fatal; any
other error of a directory fsync still is (store/fsops.fsync_dir_fd). The whole save on such a file system:
tests/torture/test_torture_faults.py::test_a_file_system_without_directory_fsync_still_commits.

No such mount runs here, so ``os.fsync`` answers for it, for directories only (files are fsynced as ever)."""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from safepoint.store import fsops
from safepoint.store.rootfs import RootDir


def _directories_answer(monkeypatch: pytest.MonkeyPatch, err: int) -> list[int]:
    real = os.fsync
    refused: list[int] = []

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            refused.append(fd)
            raise OSError(err, os.strerror(err))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(fsops, "_NO_DIR_FSYNC", set())
    return refused


@pytest.mark.parametrize("how", ["path", "walked"])
def test_einval_is_said_once_per_file_system(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    refused = _directories_answer(monkeypatch, errno.EINVAL)
    (tmp_path / "a").mkdir()
    root = RootDir(tmp_path)
    sync: Callable[[str], None] = (
        (lambda rel: fsops.fsync_dir(tmp_path / rel)) if how == "path" else root.fsync_dir
    )
    with caplog.at_level(logging.WARNING, logger="safepoint"):
        for rel in ("", "a", "a", ""):
            sync(rel)
    assert len(refused) == 4
    said = [r.getMessage() for r in caplog.records if "cannot fsync a directory" in r.getMessage()]
    assert len(said) == 1 and str(tmp_path) in said[0]


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC, errno.EBADF])
def test_any_other_error_of_a_directory_fsync_is_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int
) -> None:
    _directories_answer(monkeypatch, err)
    with pytest.raises(OSError) as e:
        fsops.fsync_dir(tmp_path)
    assert e.value.errno == err
    with pytest.raises(OSError) as e:
        RootDir(tmp_path).fsync_dir()
    assert e.value.errno == err
