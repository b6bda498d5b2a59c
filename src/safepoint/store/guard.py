"""What a hostile or damaged root cannot make safepoint do (docs/reliability.md, "Threat model").

- Name a step any other way than ``step-(0|[1-9][0-9]*)`` (``step-02`` and ``step-٢`` are not step 2).
- Name a file outside its checkpoint: every file name in a manifest or in ``.metadata`` is a bare name.
- Open anything but a regular file: no symlink is followed (O_NOFOLLOW), a FIFO never blocks
  (O_NONBLOCK, then fstat), a directory or device is refused.
- Make a delete follow a symlink: trees are removed through directory descriptors, and a path that is a
  symlink (or not a directory) is left where it is and reported.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from torch.distributed.checkpoint.api import CheckpointException

from safepoint.errors import CheckpointError, CorruptCheckpointError, StateMismatchError

STEP_PREFIX = "step-"
METADATA_FILE = ".metadata"  # storage.METADATA_NAME (storage imports this module)
# The one step-name pattern, used for directories and object prefixes alike. ASCII digits only (Python's
# \d also matches other scripts' digits) and no leading zeros: step-02 and step-٢ are not step 2.
STEP_PATTERN = r"step-(?:0|[1-9][0-9]*)"
STEP_RE = re.compile(rf"^{STEP_PATTERN}$")


def parse_step(name: str) -> int | None:
    """The step a directory (or object prefix) name stands for, or None if it is not exactly a step name."""
    return int(name[len(STEP_PREFIX) :]) if STEP_RE.match(name) else None


# A step parked aside while it is replaced: only this exact shape is ever moved back into ROOT, so a
# planted ".pending/replaced-..-x" can never name ROOT's parent (or ROOT itself) as the step to replace.
PARKED_RE = re.compile(rf"^replaced-({STEP_PATTERN})-[0-9a-f]{{8}}$")


def parked_step_name(name: str) -> str | None:
    """The step directory a parked replacement ``replaced-step-N-<8 hex>`` belongs to, or None."""
    m = PARKED_RE.match(name)
    return m.group(1) if m else None


def bare_name_problem(name: object) -> str | None:
    """Why ``name`` is not a plain file name inside one directory, or None if it is one."""
    if not isinstance(name, str):
        return f"{name!r} is a {type(name).__name__}, not a file name"
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\x00" in name:
        return f"{name!r} is not a plain file name (a path outside the checkpoint?)"
    return None


def open_regular(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of ``path`` if it is a regular file, not reached through a symlink.

    O_NONBLOCK keeps a FIFO from blocking the open; once fstat says regular file it is cleared (it means
    nothing for regular files anyway). Raises OSError (ELOOP for a symlink) or NotRegularFileError.
    """
    return keep_if_regular(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC), path)


def keep_if_regular(fd: int, what: str | os.PathLike[str] | Callable[[], os.PathLike[str]]) -> int:
    """``fd`` (opened with O_NONBLOCK, so a FIFO never blocked the open) back in blocking mode if it is a
    regular file; otherwise closed, and NotRegularFileError naming ``what`` (a callable: its answer, asked
    only then; RootDir's reads build the full path for the message alone, ~5 us a read)."""
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            named = os.fspath(what() if callable(what) else what)
            raise NotRegularFileError(f"{named} is {describe_mode(mode)}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | os.PathLike[str], limit: int) -> bytes:
    """The whole of the regular file ``path`` (:func:`open_regular`: no symlink, FIFO or device), at most
    ``limit`` bytes: a larger one raises OSError rather than being read without bound."""
    fd = open_regular(path)
    try:
        chunks: list[bytes] = []
        size = 0
        # In chunks: os.read(fd, n) allocates n bytes first, whatever the file holds (a limit taken from a
        # forged manifest, 2**62, would raise MemoryError before a byte is read).
        while size <= limit and (chunk := os.read(fd, min(limit + 1 - size, _CHUNK))):
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise OSError(f"{os.fspath(path)} is larger than {limit} bytes")
    return b"".join(chunks)


_CHUNK = 1 << 20


def read_up_to(f: BinaryIO, limit: int) -> bytes:
    """At most ``limit`` bytes of ``f``, read in chunks: never an allocation of ``limit`` bytes up front."""
    chunks: list[bytes] = []
    while limit > 0 and (chunk := f.read(min(limit, _CHUNK))):
        chunks.append(chunk)
        limit -= len(chunk)
    return b"".join(chunks)


class NotRegularFileError(OSError):
    """A checkpoint file that is a FIFO, directory, device or socket."""


def describe_mode(mode: int) -> str:
    for test, what in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return "of an unknown file type"


MISSING = "file is missing"
"""file_problem's reason for a file that is not there (`safepoint verify` tells a node's copy by it)."""


def file_problem(path: Path) -> str | None:
    """Why a checkpoint file cannot be read as one (lstat: a symlink is refused, never followed)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return MISSING
    except OSError as e:
        return f"cannot stat ({e.strerror or e})"
    if not stat.S_ISREG(mode):
        return f"{describe_mode(mode)}, not a regular file"
    return None


def real_dir_problem(path: Path) -> str | None:
    """Why ``path`` is not a real directory (a symlink to one is not), or None; None if it is missing."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    return None if stat.S_ISDIR(mode) else describe_mode(mode)


def remove_tree(path: Path) -> str | None:
    """Delete the real directory ``path`` and everything in it, never following a symlink.

    ``shutil.rmtree`` on Linux walks through directory descriptors (``rmtree.avoids_symlink_attacks``): a
    symlink inside is unlinked, not followed. ``path`` itself: a symlink is unlinked (the link is ours to
    remove, its target is not), anything else that is not a directory is left alone. Returns what was left
    alone and why, or None.
    """
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # gone, or its parent is not a directory
        return None
    if stat.S_ISLNK(mode):
        os.unlink(path)
        return None
    if not stat.S_ISDIR(mode):
        return f"{path} is {describe_mode(mode)}; left alone"
    if not shutil.rmtree.avoids_symlink_attacks:  # pragma: no cover - every Linux Python has it
        raise OSError(f"refusing to delete {path}: this platform's rmtree can follow symlinks")
    shutil.rmtree(path, ignore_errors=True)
    return None


def remove_tree_from(path: Path, first: str, expected: tuple[int, int] | None) -> bool:
    """Unlink ``path``/``first``, then (only if that worked) the whole directory :func:`remove_tree`.

    ``first`` is unlinked through a descriptor of ``path`` opened without following a symlink and checked
    to be the directory ``expected`` (device, inode): a ``path`` swapped for a symlink, or for another
    directory, after the caller looked can never make this unlink a file elsewhere. Returns False, having
    deleted nothing, when ``path`` is no longer that directory; True otherwise (also when unlinking
    ``first`` failed and the directory was left intact)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if expected is not None and (st.st_dev, st.st_ino) != expected:
            return False
        os.unlink(first, dir_fd=fd)
    except FileNotFoundError:
        pass
    except OSError:
        return True
    finally:
        os.close(fd)
    try:
        now = os.lstat(path)
    except OSError:
        return True
    if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):  # else what stands there now is not ours
        remove_tree(path)
    return True


def remove_flat(name: str, dfd: int) -> bool:
    """Delete the directory ``name`` (in ``dfd``) if it holds no directory (a checkpoint's step): each entry
    unlinked from a descriptor of it opened O_NOFOLLOW (unlinkat never follows a symlink: a link goes, not
    its target), then the directory; rmtree's generic walk cost more than the deletes (issue 27). False,
    what is left left, where that is not so (a subdirectory: EISDIR) or anything fails: rmtree goes on."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return False
    try:
        for entry in os.listdir(fd):
            os.unlink(entry, dir_fd=fd)
        os.rmdir(name, dir_fd=dfd)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def file_identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """(st_dev, st_ino, size, mtime ns): the very inode as it was written (store/links.py)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def link_at(src_fd: int, dst_fd: int, name: str, expected: tuple[int, int, int, int]) -> bool:
    """Hard-link ``name`` from the directory ``src_fd`` into the directory ``dst_fd`` (never following a
    link: ``linkat`` names whatever is there), and keep it only if the new entry is a regular file of the
    ``expected`` identity; anything else (a symlink, a FIFO, another inode) is unlinked again. False then,
    or if the link cannot be made."""
    try:
        os.link(name, name, src_dir_fd=src_fd, dst_dir_fd=dst_fd, follow_symlinks=False)
        made = os.stat(name, dir_fd=dst_fd, follow_symlinks=False)
    except OSError:
        return False
    if stat.S_ISREG(made.st_mode) and file_identity(made) == expected:
        return True
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dst_fd)
    return False


def check_bare(step: int | None, name: object, what: str) -> str:
    """``name`` if it is a bare file name, else CorruptCheckpointError naming ``what`` it came from."""
    problem = bare_name_problem(name)
    if problem is not None:
        raise CorruptCheckpointError(step, what, problem)
    assert isinstance(name, str)
    return name


# ---- what a failure while reading means ------------------------------------------------------------------


def as_corruption(step: int, e: BaseException) -> CheckpointError:
    """What a failure while reading a verified checkpoint's bytes means: that checkpoint is corrupt (the
    caller warns and falls back), whatever was raised (EOFError, PermissionError, a zip error from
    torch.load, DCP's CheckpointException around any of them). A StateMismatchError stays what it is."""
    causes: list[BaseException] = [e]
    if isinstance(e, CheckpointException):
        causes = [exc for _rank, (exc, _tb) in sorted(e.failures.items())] or [e]
    for c in causes:
        if isinstance(c, CorruptCheckpointError):
            return type(c)(step if c.step is None else c.step, c.file, c.reason)
    for c in causes:
        if isinstance(c, StateMismatchError):
            return c
    first = causes[0]
    lines = str(first).strip().splitlines()
    return CorruptCheckpointError(
        step, None, f"unreadable ({type(first).__name__}: {lines[0] if lines else ''})"
    )
