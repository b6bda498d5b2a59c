"""What a hostile or damaged root cannot make safepoint do (docs/reliability.md, "Threat model").

- Name a step any other way than ``step-(0|[1-9][0-9]*)`` (``step-02`` and ``step-٢`` are not step 2).
- Name a file outside its checkpoint: every file name in a manifest or in ``.metadata`` is a bare name.
- Open anything but a regular file: no symlink is followed (O_NOFOLLOW), a FIFO never blocks
  (O_NONBLOCK, then fstat), a directory or device is refused.
- Make a delete follow a symlink: trees are removed through directory descriptors, and a path that is a
  symlink (or not a directory) is left where it is and reported.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import stat
from pathlib import Path

import crc32c
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

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
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(f"{os.fspath(path)} is {describe_mode(mode)}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


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


def file_problem(path: Path) -> str | None:
    """Why a checkpoint file cannot be read as one (lstat: a symlink is refused, never followed)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "file is missing"
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


def check_bare(step: int | None, name: object, what: str) -> str:
    """``name`` if it is a bare file name, else CorruptCheckpointError naming ``what`` it came from."""
    problem = bare_name_problem(name)
    if problem is not None:
        raise CorruptCheckpointError(step, what, problem)
    assert isinstance(name, str)
    return name


# ---- .metadata: every field DCP will use, checked before DCP uses it --------------------------------------


def _is_index(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_shape(v: object, dims: int | None = None) -> bool:
    return isinstance(v, torch.Size) and all(_is_index(d) for d in v) and (dims is None or len(v) == dims)


def metadata_problem(md: Metadata, sizes: dict[str, int]) -> str | None:
    """Why ``md`` cannot be a checkpoint's metadata whose files have ``sizes`` (the manifest's), or None.

    Storage paths must be bare names the manifest lists (an absolute path or ``..`` would read outside
    the checkpoint, another bucket on S3); every item must lie inside its file (a past-the-end offset or a
    4 GiB length would otherwise read elsewhere or allocate at will); every field must have DCP's type.
    """
    entries = md.state_dict_metadata
    if not isinstance(entries, dict) or not all(isinstance(k, str) for k in entries):
        return "state_dict_metadata is not a {name: metadata} dict"
    for key, entry in entries.items():
        if problem := _entry_problem(entry):
            return f"entry {key!r}: {problem}"
    if md.planner_data is not None and not isinstance(md.planner_data, dict):
        return f"planner_data is a {type(md.planner_data).__name__}, not a dict"
    if not isinstance(md.storage_data, dict):
        return f"storage_data is a {type(md.storage_data).__name__}, not a dict"
    for index, info in md.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            return f"storage_data key {index!r} is not a MetadataIndex"
        if problem := _storage_problem(info, sizes):
            return f"item {index.fqn!r}: {problem}"
    return None


def _entry_problem(entry: object) -> str | None:
    if isinstance(entry, BytesStorageMetadata):
        return None
    if not isinstance(entry, TensorStorageMetadata):
        return f"a {type(entry).__name__}, not tensor or bytes metadata"
    if not isinstance(entry.properties, TensorProperties) or not isinstance(
        entry.properties.dtype, torch.dtype
    ):
        return "tensor properties without a dtype"
    if not _is_shape(entry.size) or not isinstance(entry.chunks, list):
        return "malformed size or chunk list"
    for chunk in entry.chunks:
        if not isinstance(chunk, ChunkStorageMetadata):
            return f"a chunk is a {type(chunk).__name__}"
        dims = len(entry.size)
        if not (_is_shape(chunk.offsets, dims) and _is_shape(chunk.sizes, dims)):
            return "a chunk's offsets or sizes do not match the tensor's dimensions"
        if any(o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, entry.size, strict=True)):
            return "a chunk lies outside the tensor"
    return None


def _storage_problem(info: object, sizes: dict[str, int]) -> str | None:
    if not isinstance(info, _StorageInfo):
        return f"storage info is a {type(info).__name__}"
    if problem := bare_name_problem(info.relative_path):
        return f"storage path {problem}"
    if info.relative_path not in sizes or info.relative_path == METADATA_FILE:
        return f"storage path {info.relative_path!r} is not a data file the manifest lists"
    if not (_is_index(info.offset) and _is_index(info.length)):
        return f"offset {info.offset!r} and length {info.length!r} must be non-negative integers"
    if info.offset + info.length > sizes[info.relative_path]:
        return (
            f"bytes {info.offset}..{info.offset + info.length} lie outside {info.relative_path!r} "
            f"({sizes[info.relative_path]} bytes)"
        )
    descriptors = info.transform_descriptors
    if descriptors is not None and not (
        isinstance(descriptors, list | tuple) and all(isinstance(d, str) for d in descriptors)
    ):
        return "transform descriptors are not a list of names"
    return None


def load_checked_metadata(step: int, data: bytes, files: dict[str, tuple[int, str]]) -> Metadata:
    """``.metadata`` from ``data``: its bytes checked against the manifest (``files``: name -> (size,
    crc32c)), unpickled with the allowlist, then its structure checked. CorruptCheckpointError otherwise."""
    from safepoint.storage import safe_load_metadata  # storage imports this module

    if METADATA_FILE not in files:
        raise CorruptCheckpointError(step, METADATA_FILE, "not listed in the manifest (not a DCP checkpoint)")
    size, crc = files[METADATA_FILE]
    actual = f"{crc32c.crc32c(data):08x}"
    if len(data) != size or actual != crc:
        why = f"size {len(data)}, crc32c {actual}; the manifest says {size}, {crc}"
        raise CorruptCheckpointError(step, METADATA_FILE, f"{why} (changed after verification?)")
    try:
        md = safe_load_metadata(io.BytesIO(data))
    except CorruptCheckpointError as e:
        raise type(e)(step, METADATA_FILE, e.reason) from None
    if problem := metadata_problem(md, {name: s for name, (s, _) in files.items()}):
        raise CorruptCheckpointError(step, METADATA_FILE, problem)
    return md


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
