"""File-system calls the standard library has no binding for, and durable writes (fsync'd).

One of the guarded modules (with store/rootfs.py and store/guard.py) that tests/test_architecture.py lets
call the file system by path: the commit protocol's renameat2 exchange and fsyncs live here so that the
torture suite (tests/torture/faults.py) can patch them in one place."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from pathlib import Path

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux renameat2(RENAME_EXCHANGE); False where unsupported.

    The stdlib has no binding for renameat2, hence ctypes.
    """
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: Path, data: bytes) -> None:
    """``data`` into ``path`` (created or truncated), fsync'd. O_NOFOLLOW: a symlink planted at the name
    fails the write (ELOOP) instead of being written through; callers pass a directory they made."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(os.open(path, flags, 0o644), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
