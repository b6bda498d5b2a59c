"""File-system calls the standard library has no binding for, and durable writes (fsync'd)."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
from pathlib import Path

log = logging.getLogger("safepoint")

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux renameat2(RENAME_EXCHANGE); False where unsupported."""
    return rename_exchange_at(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), str(b))


def rename_exchange_at(a_dir: int, a: str | bytes, b_dir: int, b: str | bytes, what: str) -> bool:
    """renameat2(a_dir, a, b_dir, b, RENAME_EXCHANGE) (names relative to directory descriptors, as
    store/rootfs.py walks them); False where unsupported. The stdlib has no binding for renameat2, hence
    ctypes."""
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    rc = fn(a_dir, os.fsencode(a), b_dir, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), what)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fsync_dir_fd(fd, path)
    finally:
        os.close(fd)


_NO_DIR_FSYNC: set[int] = set()  # the devices already said to have no directory fsync (warned once each)


def fsync_dir_fd(fd: int, what: str | os.PathLike[str]) -> None:
    """fsync the directory open as ``fd`` (``what``: its path, for the message), which makes the names in it
    durable. EINVAL means the file system has no directory fsync at all (the kernel's answer where it lacks
    the operation: CIFS/SMB, some FUSE and object-store mounts), not that a write was lost: the names then
    rest on the file system's own durability (an SMB server commits a rename before answering), as
    PostgreSQL and SQLite treat such mounts; a save there would otherwise never commit. Said once per file
    system. Any other error (EIO: a write-back failed) is raised, and the save it belongs to fails."""
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        dev = os.fstat(fd).st_dev
        if dev not in _NO_DIR_FSYNC:
            _NO_DIR_FSYNC.add(dev)
            log.warning(
                "safepoint: %s: this file system cannot fsync a directory (EINVAL); committed names rely on "
                "its own durability (as on CIFS/SMB and some FUSE mounts)",
                os.fspath(what),
            )


def write_file_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
