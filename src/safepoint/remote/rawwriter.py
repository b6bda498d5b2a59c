"""The write streams DCP's writer streams into (``RawWriter``), the generic one over an fsspec file system,
and the error a failed stream raises."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import IO, Any

import crc32c

from safepoint.remote.retry import UploadError


class StreamWriteError(UploadError, OSError):
    """An upload that failed inside ``write()``: an OSError too, as a failed file write is. torch's zip writer
    turns an exception from the stream's write into "unexpected pos" RuntimeError and keeps the original
    only as its context, where safepoint (saver.describe_exception) looks for an OSError to name the cause."""


class RawWriter:
    """What the DCP writer streams into: bytes go in, ``close`` makes the object, ``abort`` drops it."""

    def write(self, data: Any) -> int:
        raise NotImplementedError

    def flush(self) -> None:
        pass

    def close(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


class FsWriter(RawWriter):
    """A write stream through the file system's own ``open`` (the stores without one of their own)."""

    def __init__(self, fs: Any, path: str) -> None:
        self._fs, self._path = fs, path
        self._f: IO[bytes] = fs.open(path, "wb")
        self._done = False

    def write(self, data: Any) -> int:
        n = self._f.write(data)
        return len(memoryview(data)) if n is None else int(n)

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._finish()

    def _finish(self) -> None:
        self._f.close()

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        discard = getattr(self._f, "discard", None)
        try:
            if callable(discard):
                discard()
            self._f.close()
        finally:
            with contextlib.suppress(OSError):
                self._drop()

    def _drop(self) -> None:
        self._fs.rm(self._path)


class FdWriter(FsWriter):
    """A write stream into a file already created through the guarded walk (a ``file://`` root's
    ``ObjectStore.guard``): written by descriptor, fsync'd on close; ``abort`` unlinks it through
    ``remove`` (the walk again), so no path below the root is ever followed as a symlink."""

    def __init__(self, fd: int, remove: Callable[[], None]) -> None:
        self._f = os.fdopen(fd, "wb")
        self._remove = remove
        self._done = False

    def _finish(self) -> None:
        with self._f:
            self._f.flush()
            os.fsync(self._f.fileno())

    def _drop(self) -> None:
        self._remove()


def stream_into(src: Any, fd: int, piece: int, limit: int | None = None) -> tuple[int, int]:
    """``src`` (a readable file) written into ``fd`` from offset 0, ``piece`` bytes a read, at most ``limit``
    bytes when given: (crc32c of what was written, bytes written)."""
    value, got = 0, 0
    while limit is None or got < limit:
        chunk = src.read(piece if limit is None else min(piece, limit - got))
        if not chunk:
            break
        value = crc32c.crc32c(chunk, value)
        write_at(fd, chunk, got)
        got += len(chunk)
    return value, got


def write_at(fd: int, data: bytes, offset: int) -> None:
    """All of ``data`` at ``offset`` of ``fd`` (pwrite may write less than asked)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
