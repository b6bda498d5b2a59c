"""crc32c checksums: computed as bytes stream out (no re-read on save) and in chunks when verifying."""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import IO, Any

import crc32c

from safepoint.store.guard import open_regular

_CHUNK = 8 * 1024 * 1024
# Local files are checksummed in 1 MiB pieces read into one reused buffer: the crc32c then reads what the
# copy just left in the CPU cache (8 MiB pieces measured ~10% slower with a warm page cache).
_READ_CHUNK = 1024 * 1024
# Files bigger than this are verified as several ranges read concurrently: one sequential reader leaves
# a virtual disk mostly idle (measured 2x faster from a cold cache with 4-8 readers).
_MIN_RANGE = 32 * 1024 * 1024
# A write at least this big gets its crc32c computed on a helper thread while the bytes go to the file
# (both release the GIL), so checksumming hides behind the write instead of adding to it (~0.16 s of CPU
# per GiB at 6 GB/s). Only with a core to spare: on a busy 2-core VM every hand-off waited for a core and
# saves got ~1.2x slower than checksumming inline, so below _OVERLAP_MIN_CPUS usable CPUs it runs inline.
_OVERLAP_MIN = 1024 * 1024
_OVERLAP_MIN_CPUS = 3


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def crc_hex(value: int) -> str:
    return f"{value:08x}"


def file_crc32c(path: str | os.PathLike[str]) -> tuple[int, str]:
    """Return (size, crc32c hex) of a local file, reading it in chunks (bounded memory)."""
    with os.fdopen(open_regular(path), "rb", buffering=0) as f:  # no symlink, no FIFO (guard)
        return stream_crc32c(f, chunk_size=_READ_CHUNK)


def stream_crc32c(f: IO[bytes], chunk_size: int = _CHUNK) -> tuple[int, str]:
    value = 0
    size = 0
    buf = bytearray(chunk_size)
    view = memoryview(buf)
    readinto = getattr(f, "readinto", None)
    while True:
        if readinto is not None:
            n = readinto(view)
            if not n:
                break
            value = crc32c.crc32c(view[:n], value)
        else:
            chunk = f.read(chunk_size)
            if not chunk:
                break
            n = len(chunk)
            value = crc32c.crc32c(chunk, value)
        size += n
    return size, crc_hex(value)


def crc_ranges(size: int, max_parts: int) -> list[tuple[int, int]]:
    """Split a file of ``size`` bytes into (offset, length) ranges, at most ``max_parts``, none tiny."""
    parts = max(1, min(max_parts, size // _MIN_RANGE))
    step = -(-size // parts) if size else 0
    return [(off, min(step, size - off)) for off in range(0, size, step)] if size else [(0, 0)]


def range_crc32c(path: str | os.PathLike[str], offset: int, length: int) -> int:
    """crc32c (int) of ``length`` bytes at ``offset`` of a local file, read through its own descriptor.

    Combine the ranges of one file with ``crc32c_combine``. Raises EOFError if the file ends early.
    """
    # A regular file only, never through a symlink; a FIFO put in a checkpoint must not block.
    fd = open_regular(path)
    try:
        return fd_range_crc32c(fd, offset, length, os.fspath(path))
    finally:
        os.close(fd)


def fd_range_crc32c(fd: int, offset: int, length: int, what: str, value: int = 0) -> int:
    """``range_crc32c`` of an open descriptor (positioned reads; memory bounded by one chunk), extending
    ``value`` (the crc32c of the bytes before the range)."""
    if not length:
        return value
    buf = bytearray(min(_READ_CHUNK, length))
    view = memoryview(buf)
    pos, end = offset, offset + length
    while pos < end:
        n = os.preadv(fd, [view[: min(len(buf), end - pos)]], pos)
        if not n:
            raise EOFError(f"{what} ends at byte {pos}, expected at least {end}")
        value = crc32c.crc32c(view[:n], value)
        pos += n
    return value


class ReadCoverage:
    """The crc32c of a whole file, built from the pieces a reader reads (in offset order) plus the gaps
    between them, read here: what was loaded is checked against the manifest, not what was verified
    earlier (the file could have been replaced in between). ``finish`` returns the file's crc32c hex."""

    def __init__(self, gap_crc: Callable[[int, int], int], size: int, what: str) -> None:
        """``gap_crc(offset, length)`` reads that range (of a local file, an object) and returns its crc."""
        self._gap_crc, self._size, self._what = gap_crc, size, what
        self._crc, self._pos = 0, 0
        self._last: tuple[int, int] | None = None

    def running(self, offset: int, length: int) -> int | None:
        """The crc32c of the file up to ``offset`` (gaps read here), for the reader to extend with the
        ``length`` bytes it reads there and hand to ``extended``; None if that item was just read."""
        if (offset, length) == self._last:
            return None  # the same item read again (two requests of one stored item)
        if offset < self._pos:
            raise ValueError(f"{self._what}: items overlap at byte {offset}")
        self._gap_to(offset)
        return self._crc

    def extended(self, offset: int, length: int, crc: int) -> None:
        """``crc`` is ``running(offset, length)`` extended by the bytes read there."""
        self._crc, self._pos, self._last = crc, offset + length, (offset, length)

    def add(self, offset: int, length: int, crc: int) -> None:
        """``crc`` covers ``length`` bytes at ``offset``; pieces come in offset order."""
        if (offset, length) == self._last:
            return  # the same item read again (two requests of one stored item)
        if offset < self._pos:
            raise ValueError(f"{self._what}: items overlap at byte {offset}")
        self._gap_to(offset)
        self._crc = crc32c_combine(self._crc, crc, length)
        self._pos, self._last = offset + length, (offset, length)

    def finish(self) -> str:
        self._gap_to(self._size)
        return crc_hex(self._crc)

    def _gap_to(self, offset: int) -> None:
        if offset > self._pos:
            gap = self._gap_crc(self._pos, offset - self._pos)
            self._crc = crc32c_combine(self._crc, gap, offset - self._pos)
            self._pos = offset


# crc32c_combine: zlib's crc32_combine (x^(8*len2) mod P by repeated squaring), for the Castagnoli
# polynomial (reflected). _X2N[k] = x^(2^k) mod P; unlike zlib's CRC-32 table it does not repeat with
# period 32 for this polynomial, so it is built for every bit of a 64-bit length.
_POLY = 0x82F63B78


def _multmodp(a: int, b: int) -> int:
    """a * b modulo P, polynomials as reflected 32-bit ints."""
    m = 1 << 31
    p = 0
    while m:
        if a & m:
            p ^= b
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    table = []
    p = 1 << 30  # x^1
    for _ in range(64):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32c(A + B) from crc1 = crc32c(A), crc2 = crc32c(B) and len2 = len(B), without the bytes."""
    op = 1 << 31  # x^0
    k = 3  # 8 bits per byte: x^(8 * len2) = product of x^(2^(k)) over the set bits of len2, shifted by 3
    n = len2
    while n:
        if n & 1:
            op = _multmodp(_X2N[k], op)
        n >>= 1
        k += 1
    return _multmodp(op, crc1) ^ crc2


class ChecksumRecorder:
    """Thread-safe record of {file name: (size, crc32c hex)} for the files one writer produced.

    DCP writes a rank's files from several threads; each finished stream reports here.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[str, tuple[int, str]] = {}
        self._failures: list[tuple[str, BaseException]] = []

    def failed(self, name: str, error: BaseException) -> None:
        """A stream's write failed: DCP's extra writer threads swallow the exception, so keep it here."""
        with self._lock:
            self._failures.append((name, error))

    def first_failure(self) -> tuple[str, BaseException] | None:
        with self._lock:
            return self._failures[0] if self._failures else None

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
        self._helper: concurrent.futures.ThreadPoolExecutor | None = None
        # Asked at the first write big enough to overlap, not per stream: a save's small files (its
        # .metadata, manifest, side file) never overlap, and the affinity call was one system call each.
        self._overlap: bool | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes >= _OVERLAP_MIN and self._overlap is None:
            self._overlap = _usable_cpus() >= _OVERLAP_MIN_CPUS
        if view.nbytes < _OVERLAP_MIN or not self._overlap:
            n = self._raw.write(data)
            written = view[: n if n is not None else None]
            self._crc = crc32c.crc32c(written, self._crc)
        else:
            # Tensor payloads: checksum on the helper thread while this one writes the same bytes.
            if self._helper is None:
                self._helper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="safepoint-crc")
            pending = self._helper.submit(crc32c.crc32c, view, self._crc)
            try:
                n = self._raw.write(data)
            finally:
                # Always wait: the helper reads the caller's buffer, which must not be reused under it.
                concurrent.futures.wait([pending])
            written = view[: n if n is not None else None]
            if len(written) == view.nbytes:
                self._crc = pending.result()
            else:  # a short write: the checksum covers only what reached the file
                self._crc = crc32c.crc32c(written, self._crc)
        self._size += len(written)
        return len(written)

    def tell(self) -> int:
        return self._size

    def fileno(self) -> int:
        # DCP calls os.fsync(stream.fileno()) before close(): bytes still in Python's buffer would not be
        # durable. Flushing here makes that fsync cover everything written so far.
        self._raw.flush()
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
        self._stop_helper()
        self._raw.close()
        # Recorded only on a clean close: a stream that died mid-write never gets a checksum, so its
        # file can never be listed in a manifest.
        self._recorder.record(self._name, self._size, crc_hex(self._crc))

    def __enter__(self) -> ChecksummingWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self._closed = True
            self._stop_helper()
            self._raw.close()
            return
        self.close()

    def _stop_helper(self) -> None:
        if self._helper is not None:
            self._helper.shutdown(wait=True)
            self._helper = None
