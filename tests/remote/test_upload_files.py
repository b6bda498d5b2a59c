"""Uploads read local checkpoint files as regular files only: a symlink in a committed local step is never
followed (it would upload a file from outside the local root), a FIFO never blocks the uploader."""

from __future__ import annotations

import os
from pathlib import Path

import fsspec
import pytest

from safepoint.remote.upload import FileCopy, ObjectStore, read_range


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_uploads_refuse_a_local_file_that_is_not_regular(tmp_path: Path, kind: str) -> None:
    secret = tmp_path / "outside.txt"
    secret.write_bytes(b"not a checkpoint file")
    local = tmp_path / "step-1" / "__0_0.distcp"
    local.parent.mkdir()
    if kind == "symlink":
        local.symlink_to(secret)
    else:
        os.mkfifo(local)  # opened without O_NONBLOCK this would block the test forever
    with pytest.raises(OSError):
        read_range(local, 0, 4)
    store = ObjectStore(fsspec.filesystem("file"))
    item = FileCopy(local=str(local), remote=str(tmp_path / "up" / "x"), size=21, crc32c="")
    with pytest.raises(OSError):
        store._stream_up(item)
    assert not (tmp_path / "up" / "x").exists() or (tmp_path / "up" / "x").read_bytes() == b""
