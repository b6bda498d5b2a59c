"""crc32c checksums: computed as bytes stream out (no re-read on save) and in chunks when verifying."""

from __future__ import annotations

import os
import threading
from typing import IO, Any

import crc32c

_CHUNK = 8 * 1024 * 1024


def crc_hex(value: int) -> str:
    return f"{value:08x}"


def file_crc32c(path: str | os.PathLike[str]) -> tuple[int, str]:
    """Return (size, crc32c hex) of a local file, reading it in chunks (bounded memory)."""
    with open(path, "rb", buffering=0) as f:
        return stream_crc32c(f)


def stream_crc32c(f: IO[bytes]) -> tuple[int, str]:
    value = 0
    size = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    readinto = getattr(f, "readinto", None)
    while True:
        if readinto is not None:
            n = readinto(view)
            if not n:
                break
            value = crc32c.crc32c(view[:n], value)
        else:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            n = len(chunk)
            value = crc32c.crc32c(chunk, value)
        size += n
    return size, crc_hex(value)


class ChecksumRecorder:
    """Thread-safe record of {file name: (size, crc32c hex)} for the files one writer produced.

    DCP writes a rank's files from several threads; each finished stream reports here.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[str, tuple[int, str]] = {}

    def record(self, name: str, size: int, crc: str) -> None:
        with self._lock:
            self._files[name] = (size, crc)

    def rename(self, old: str, new: str) -> None:
        with self._lock:
            if old in self._files:
                self._files[new] = self._files.pop(old)

    def snapshot(self) -> dict[str, tuple[int, str]]:
        with self._lock:
            return dict(self._files)


class ChecksummingWriter:
    """A binary write stream that updates a crc32c and a byte count as data passes through.

    Wraps the real file so DCP's own write path (``torch.save`` per item, ``fsync``) is unchanged; the
    checksum comes for free instead of re-reading gigabytes after the write.
    """

    def __init__(self, raw: IO[bytes], name: str, recorder: ChecksumRecorder) -> None:
        self._raw = raw
        self._name = name
        self._recorder = recorder
        self._crc = 0
        self._size = 0
        self._closed = False

    def write(self, data: Any) -> int:
        n = self._raw.write(data)
        written = memoryview(data).cast("B")[: n if n is not None else None]
        self._crc = crc32c.crc32c(written, self._crc)
        self._size += len(written)
        return len(written)

    def tell(self) -> int:
        return self._size

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        self._raw.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._raw.close()
        # Recorded only on a clean close: a stream that died mid-write never gets a checksum, so its
        # file can never be listed in a manifest.
        self._recorder.record(self._name, self._size, crc_hex(self._crc))

    def __enter__(self) -> ChecksummingWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self._closed = True
            self._raw.close()
            return
        self.close()
