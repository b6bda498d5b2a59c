"""The commit protocol's file operations (store/posix_layout.py), each through the guarded walk from ROOT.

They are module-level functions taking paths because tests patch them by name in ``posix_layout``:
tests/torture/faults.py wraps ``_rename_exchange`` (a file system without renameat2), tests/torture/
scenarios.py puts back old bugs that call ``remove_tree``/``_identity``/``write_file_durably``, and
tests/policy/test_deleter.py holds ``remove_tree`` to show deletes run off the saving thread. Each path is
ROOT/step-N or ROOT/.pending/<name> (:func:`root_of`), walked from ROOT with O_NOFOLLOW on every component
(store/rootfs.py): a symlinked ``.pending`` or step directory is never followed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from safepoint.store.checksum import fd_range_crc32c
from safepoint.store.guard import MISSING, describe_mode, parse_step
from safepoint.store.manifest import MANIFEST_NAME
from safepoint.store.root_cache import root_dir
from safepoint.store.rootfs import RootDir


def root_of(path: Path) -> RootDir:
    """The ROOT that ``path`` lies in: ROOT/step-N's parent, or ROOT/.pending/<name>'s grandparent."""
    return root_dir(path.parent if parse_step(path.name) is not None else path.parent.parent)


def identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of ``path`` itself (a symlink is not followed, nor one on the way), or None."""
    st = root_of(path).lstat(path)
    return None if st is None else (st.st_dev, st.st_ino)


def rename_exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` (ROOT/step-N) atomically: renameat2(RENAME_EXCHANGE) between their walked
    directories; False where the file system has no such call (NFS)."""
    return root_of(b).exchange(a, b)


def write_file_durably(path: Path, data: bytes) -> None:
    """``data`` as the new file ``path`` in a save's directory (ROOT/.pending/<save>/<name>), fsync'd: a
    link planted at the name is unlinked, never written through (RootDir.write)."""
    root_dir(path.parent.parent.parent).write(path, data)


def remove_tree(path: Path) -> str | None:
    """Delete ``path`` and everything in it, never leaving ROOT (RootDir.remove_tree); what was left
    alone and why, or None. A tree that cannot be reached now (no descriptors left: the walk needs them
    too) is left as rmtree(ignore_errors=True) left it before the walk: its owner retries (saver._discard,
    clean_pending)."""
    try:
        return root_of(path).remove_tree(path)
    except OSError as e:
        return f"{path}: not deleted now ({e.strerror or e}); left for the next cleanup"


def remove_manifest_first(path: Path, expected: tuple[int, int] | None) -> bool:
    """Delete a checkpoint directory so it never looks whole while half-deleted: the manifest goes first,
    and if that fails the directory is left intact (recovery may then put back only complete copies).
    False, having deleted nothing, if ``path`` is no longer the directory ``expected``."""
    return root_of(path).remove_tree_from(path, MANIFEST_NAME, expected)


def file_problem(fs: RootDir, rel: str) -> str | None:
    """Why ``rel`` cannot be read as a checkpoint file (a symlink is refused, never followed), or None."""
    st = fs.lstat(rel)
    if st is None:
        return MISSING
    return None if is_regular(st) else f"{describe_mode(st.st_mode)}, not a regular file"


def is_regular(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode)


def lstat_size(fs: RootDir, rel: str) -> int:
    """``rel``'s size (-1 if it is gone)."""
    st = fs.lstat(rel)
    return -1 if st is None else st.st_size


def range_crc32c(fs: RootDir, rel: str, offset: int, length: int) -> int:
    """crc32c of ``length`` bytes at ``offset`` of the regular file ``rel`` (no symlink on the way, a FIFO
    never blocks: RootDir.open_read); EOFError if it ends early."""
    fd = fs.open_read(rel)
    try:
        return fd_range_crc32c(fd, offset, length, str(fs.full(rel)))
    finally:
        os.close(fd)
