"""Hard-linking a committed step's file into a new one, only if it is still the file that was written.

Used by the incremental layer (store/incremental.py) for the stable groups and for the file of a save's
non-tensor items (store/byte_file.py): a linked file is one inode shared by several steps, under the
blast-radius rule of docs/reliability.md (full copies, retention's fallback step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
from pathlib import Path

from safepoint.store.checksum import crc_hex, fd_range_crc32c
from safepoint.store.guard import file_identity as file_identity  # re-exported
from safepoint.store.guard import link_at
from safepoint.store.root_cache import root_dir
from safepoint.store.rootfs import RootDir

Key = tuple[str, tuple[int, ...]]  # (fqn, chunk offsets): one item of a rank's plan


@dataclasses.dataclass(frozen=True, slots=True)
class StoredFile:
    """A stable group (or the non-tensor items' file) as it lies in a committed step."""

    name: str
    infos: dict[Key, tuple[int, int]]
    """Where each of its items lies: (offset, length)."""
    size: int
    crc32c: str
    identity: tuple[int, int, int, int] | None
    """(st_dev, st_ino, size, mtime ns) as written: only this inode is ever linked into a new step. None:
    read back from a step another process committed (incremental_record.py); its bytes are checked against
    ``crc32c`` before it is linked, and the inode so checked is the one linked."""


def link_into(source: Path, target: Path, stored: StoredFile) -> StoredFile | None:
    """Hard-link the committed file ``source`` as ``target`` if it is still the file that was written;
    the file as linked (its identity), or None where it cannot be done (the caller then writes the file).

    ``linkat`` (without AT_SYMLINK_FOLLOW: it never follows a link) names whatever ``source`` is at that
    moment, so the new name is checked after the link and removed unless it is a regular file whose
    identity (st_dev, st_ino, size, mtime) is the recorded one: a symlink, a FIFO or a file swapped in is
    never kept, and nothing outside the root can become part of a step (it would have to be the very inode
    we wrote or checked inside it). That check alone proves a file of known identity, so such a source is
    not opened first (a walk, an open and two fstats per link, issue 27). A file read back from another
    process's step (no identity yet) must first hold the recorded size and crc32c, read through a
    descriptor opened as RootDir.open_read does, and not change while it is read; the inode so checked is
    the identity the link must then have."""
    # Both walked from their common directory (the root) by descriptors: no symlinked component followed.
    fs = RootDir(os.path.commonpath([source, target]))
    src, dst = fs.name(source), fs.name(target)
    if stored.identity is None:
        checked = _checked(fs, src, stored)
        if checked is None:
            return None
        stored = checked
    try:
        fs.link(src, dst)
        made = fs.lstat(dst)
    except OSError:
        return None
    if made is None or not stat.S_ISREG(made.st_mode) or file_identity(made) != stored.identity:
        with contextlib.suppress(OSError):
            fs.remove(dst)
        return None
    return stored


class Linker:
    """``link_into`` for every file one save links from one committed step directory into its pending one,
    through one descriptor of each (two guarded walks per save, not three per file: a small state's save
    links its stable group and its non-tensor items' file, issue 27). Each link is proven as in
    ``link_into``: ``linkat`` never follows a link, and the new name is kept only if it is a regular file
    with the recorded identity; a file of unknown identity, or a name that is not a plain file name, goes
    through ``link_into`` itself. The descriptors are opened at the first link and closed by ``close``."""

    def __init__(self, source: Path, target: Path) -> None:
        self.source, self.target = source, target
        self._stack: contextlib.ExitStack | None = None
        self._fds: tuple[int, int] | None = None

    def __enter__(self) -> Linker:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        if self._stack is not None:
            self._stack.close()
        self._stack, self._fds = None, None

    def _dirs(self) -> tuple[int, int] | None:
        if self._stack is None:
            self._stack = contextlib.ExitStack()
            fs = root_dir(os.path.commonpath([self.source, self.target]))
            try:
                src = self._stack.enter_context(fs.dir(self.source))  # a Path: parsed once, by dir()
                dst = self._stack.enter_context(fs.dir(self.target))
            except OSError:
                return None  # the previous step is gone (or not a real directory): nothing is linked
            self._fds = (src, dst)
        return self._fds

    def link(self, stored: StoredFile) -> StoredFile | None:
        """``stored`` linked under its own name, or None (the caller writes it)."""
        name = stored.name
        if stored.identity is None or "/" in name or name in ("", ".", ".."):
            return link_into(self.source / name, self.target / name, stored)
        if (fds := self._dirs()) is None:
            return None
        return stored if link_at(*fds, name, stored.identity) else None


def _checked(fs: RootDir, src: str, stored: StoredFile) -> StoredFile | None:
    """``stored`` with the identity of the regular file ``src`` if it holds the recorded bytes, else None."""
    try:
        fd = fs.open_read(src)
    except OSError:
        return None
    try:
        identity = file_identity(os.fstat(fd))
        if identity[2] != stored.size or not _holds(fd, stored):
            return None
        if file_identity(os.fstat(fd)) != identity:
            return None  # written to while it was read
    except OSError:
        return None
    finally:
        os.close(fd)
    return dataclasses.replace(stored, identity=identity)


def _holds(fd: int, stored: StoredFile) -> bool:
    """Whether the open file holds the recorded bytes (its crc32c, read in bounded chunks)."""
    try:
        value = fd_range_crc32c(fd, 0, stored.size, stored.name)
    except EOFError:
        return False
    return crc_hex(value) == stored.crc32c
