"""File-system calls the standard library has no binding for, and durable writes (fsync'd)."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from pathlib import Path

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
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
