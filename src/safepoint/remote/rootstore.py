"""A ``file://`` (or path) root's objects, touched only through its guarded walk (``ObjectStore.guard``).

fsspec's local file system opens paths as given: a ``step-N``, ``.run`` or file planted below the root as a
symlink is followed (written, deleted or read outside the root), and a FIFO blocks its ``open`` forever.
These helpers do what ``ObjectStore`` does for such a root through store/rootfs.py instead: every
directory below the root is opened O_NOFOLLOW, every file read is a regular file reached without a symlink
(a FIFO or device is refused, never opened blocking), every file written is created O_EXCL|O_NOFOLLOW and
fsync'd before anything (a manifest) names it.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from safepoint.remote.rawwriter import stream_into
from safepoint.store.fsops import fsync_dir
from safepoint.store.guard import NotRegularFileError
from safepoint.store.rootfs import RootDir

_PIECE = 8 << 20


@contextlib.contextmanager
def _said(path: str) -> Iterator[None]:
    """The walk's refusal in words: the kernel's ELOOP/ENOTDIR name only the component ("Not a directory:
    'step-2'" for a step-2 that is a symlink to a directory)."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR) or isinstance(e, NotRegularFileError):
            raise
        raise OSError(
            e.errno, f"{path}: a symlink (or a file) stands at it or on its way; not followed"
        ) from None


def _open(guard: RootDir, path: str) -> int:
    """A read descriptor of the regular file ``path`` (RootDir.open_read: no FIFO, device or symlink)."""
    with _said(path):
        return guard.open_read(Path(path))


def create(guard: RootDir, path: str) -> int:
    """A new file ``path`` open for writing (RootDir.create: its directories made, nothing followed)."""
    with _said(path):
        return guard.create(Path(path), parents=True)


def remove(guard: RootDir, path: str) -> None:
    """Unlink ``path`` (a symlink there: the link; missing: fine)."""
    with _said(path):
        guard.remove(Path(path))


def makedirs(guard: RootDir, path: str) -> None:
    with _said(path):
        guard.makedirs(Path(path))


def write_new(guard: RootDir, path: str, data: bytes) -> None:
    """``data`` as the file ``path`` (directories made, fsync'd)."""
    with _said(path):
        guard.write(Path(path), data, parents=True)


def make_root(guard: RootDir) -> None:
    """The root's own directory (the user's path, followed as given), and every parent made for it fsync'd
    into its own parent, as the local tier's ensure_root does: else a power loss after the first upload
    could lose the root's entry, and every checkpoint in it."""
    missing = [p for p in (guard.path, *guard.path.parents) if RootDir(p).lstat("") is None]
    guard.make()
    for created in reversed(missing):
        fsync_dir(created.parent)


def sync_dirs(guard: RootDir, prefix: str) -> None:
    """fsync the directory ``prefix`` and each one above it up to the root (deepest first): a file's own
    fsync does not make its name durable, its directory's does, and ``step-N`` is a name in the root."""
    parts = guard.parts(Path(prefix))
    for n in range(len(parts), -1, -1):
        guard.fsync_dir("/".join(parts[:n]))


def copy_within(guard: RootDir, src: str, dst: str) -> None:
    """The file ``src`` copied to ``dst`` (made, fsync'd), both through the walk."""
    with (
        os.fdopen(_open(guard, src), "rb") as fin,
        os.fdopen(create(guard, dst), "wb") as fout,
    ):
        while chunk := fin.read(_PIECE):
            fout.write(chunk)
        fout.flush()
        os.fsync(fout.fileno())


def read_whole(guard: RootDir, path: str, limit: int | None = None) -> bytes:
    """The regular file ``path``, whole (its size bounds the read: never a device read without end), or at
    most its first ``limit + 1`` bytes."""
    with os.fdopen(_open(guard, path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return f.read(size if limit is None else min(size, limit + 1))


def read_range(guard: RootDir, path: str, start: int, end: int) -> bytes:
    """Bytes ``start`` to ``end`` of the regular file ``path``."""
    fd = _open(guard, path)
    try:
        return os.pread(fd, end - start, start)
    finally:
        os.close(fd)


def size_of(guard: RootDir, path: str) -> int:
    """The size of the regular file ``path`` (FileNotFoundError if it is missing)."""
    fd = _open(guard, path)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def open_read(guard: RootDir, path: str) -> RegularFile:
    """The regular file ``path`` open for reading, as fsspec's file is used (``size``, ``seek``, ``read``)."""
    return RegularFile(_open(guard, path))


class RegularFile:
    """A buffered reader of one descriptor, with fsspec's ``size`` attribute; a context manager."""

    def __init__(self, fd: int) -> None:
        self._f = os.fdopen(fd, "rb")
        self.size = os.fstat(fd).st_size

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def read(self, n: int = -1) -> bytes:
        return self._f.read(n)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> RegularFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def download(guard: RootDir, path: str, fd: int, size: int, piece: int) -> tuple[int, int]:
    """The regular file ``path`` written into ``fd`` from offset 0, at most ``size + 1`` bytes (one more
    than expected shows a file that grew; a longer read would only fill the local disk): (crc32c, bytes)."""
    with os.fdopen(_open(guard, path), "rb") as src:
        return stream_into(src, fd, piece, limit=size + 1)
