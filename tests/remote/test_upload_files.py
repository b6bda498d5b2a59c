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


def test_uploads_walk_from_the_local_root_and_never_through_a_symlinked_directory(tmp_path: Path) -> None:
    """A directory on the way is a symlink (``local_root/step-1`` -> a directory elsewhere holding a file of
    the same name): opened by its path, the file's last component is regular and would be uploaded; walked
    from the local root (FileCopy.root, what the tiers pass), it is refused."""
    root, elsewhere = tmp_path / "local", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (elsewhere / "__0_0.distcp").write_bytes(b"someone else's bytes")
    (root / "step-1").symlink_to(elsewhere, target_is_directory=True)
    path = root / "step-1" / "__0_0.distcp"
    assert read_range(path, 0, 4)[0] == b"some"  # by path alone: read through the link
    with pytest.raises(OSError):
        read_range(path, 0, 4, str(root))
    store = ObjectStore(fsspec.filesystem("file"))
    up = tmp_path / "up" / "x"
    item = FileCopy(local=str(path), remote=str(up), size=20, crc32c="", root=str(root))
    with pytest.raises(OSError):
        store._stream_up(item)
    assert not up.exists() or up.read_bytes() == b""
    # The real file, under the root, is read by the same walk.
    (root / "step-2").mkdir()
    (root / "step-2" / "__0_0.distcp").write_bytes(b"ours")
    assert read_range(root / "step-2" / "__0_0.distcp", 0, 4, str(root))[0] == b"ours"
