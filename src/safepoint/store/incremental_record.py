"""Incremental saves across restarts: each rank's fingerprints, recorded with the step, read back by a new
process so that its first save links what did not change (store/incremental.py).

Each rank writes ``rank-<r>.fingerprints`` (JSON) into the step next to its data files: every tensor item's
fingerprint, and where each item of its stable groups lies (file, offset, length). The file is written
through the checksumming stream like every other file, so its size and crc32c ride to rank 0 and are listed
in the manifest: ``verify`` covers it and it travels with the step. Plain ``dcp.load`` never looks at it.

A new process (``History.last`` is None) reads it back from the newest committed step of its root, as
hostile input: the manifest must parse (its own checksum), the file must be listed there and its bytes must
match the listed size and crc32c, the JSON must have the expected shape (size capped), and every stable
group it names must be a file of this rank that the manifest lists. Sizes and checksums of the groups come
from the manifest, never from the side file. The groups are not trusted yet: before one is linked, its
bytes are read and checked against the manifest's crc32c (``incremental.link_into``, ``identity`` None), so
a group changed since the step was committed is written anew, never linked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import crc32c

from safepoint.errors import CheckpointError
from safepoint.store.checksum import crc_hex
from safepoint.store.incremental import Key, Record, Round, StoredFile, is_stable_group

FORMAT = 1
# A side file bigger than this is not read (about 100 bytes per tensor item: ~5 million items).
MAX_BYTES = 512 * 1024 * 1024
_HEX32 = re.compile(r"^[0-9a-f]{32}$")


@runtime_checkable
class StoreWriterLike(Protocol):
    """An object store's DCP writer that arranges incremental saves (remote/io.StoreWriter): the saver
    (another layer) knows it by this shape."""

    incremental: Round | None

    def linked_bytes(self) -> int:
        """Bytes of this rank's files copied server-side rather than sent (this save)."""

    def previous_record(self, layout: Any, rank: int) -> tuple[Record, int] | None:
        """``rank``'s record in the newest committed step of ``layout`` (a RemoteLayout), verified."""


def side_name(rank: int) -> str:
    """This rank's record file in a step (store/node_map.RANK_FILE counts it as the rank's file)."""
    return f"rank-{rank}.fingerprints"


def encode(round_: Round, since_full: int) -> bytes:
    """The side file of ``round_``'s save (after its stable groups were written and recorded): the bytes
    of ``json.dumps({"format", "since_full", "fingerprints", "files"}, separators=(",", ":"))``."""
    record = round_.record
    assert record is not None
    memo = round_.history.encoded
    fingerprints = _part(
        memo,
        "fingerprints",
        record.fingerprints,
        lambda: [[fqn, list(offset), fp.hex()] for (fqn, offset), fp in record.fingerprints.items()],
    )
    files = _part(
        memo,
        "files",
        record.files,
        lambda: {
            name: [[fqn, list(offset), at, length] for (fqn, offset), (at, length) in stored.infos.items()]
            for name, stored in record.files.items()
        },
    )
    head = b'{"format":%d,"since_full":%d,"fingerprints":' % (FORMAT, since_full)
    return head + fingerprints + b',"files":' + files + b"}"


def _part(
    memo: dict[str, tuple[Any, bytes]], name: str, value: dict[Any, Any], body: Callable[[], Any]
) -> bytes:
    """``json.dumps(body(), separators=(",", ":"))`` of one part of the side file; the last save's bytes
    where ``value`` holds what it held then, in the same order (a steady save's fingerprints and stable
    groups are its previous save's: hex-encoding and dumping them again was ~0.1 ms a save, issue 27)."""
    items = tuple(value.items())
    hit = memo.get(name)
    if hit is not None and hit[0] == items:
        return hit[1]
    data = json.dumps(body(), separators=(",", ":")).encode()
    memo[name] = (items, data)
    return data


def read_previous(layout: Any, rank: int) -> tuple[Record, int] | None:
    """(the record of ``rank``'s share of the newest committed step of a local ``layout``, its saves since
    the last full copy), or None where there is none that verifies (no step, no side file, any mismatch)."""
    try:
        return read_newest(
            layout,
            rank,
            # The guarded walk from the root, at most the listed size.
            lambda step, size: layout.fs.read(Path(layout.step_path(step)) / side_name(rank), size),
            lambda step: Path(layout.step_path(step)),
        )
    except (CheckpointError, OSError, ValueError):
        return None


def read_newest(
    layout: Any,
    rank: int,
    read: Callable[[int, int], bytes],
    directory: Callable[[int], Path],
) -> tuple[Record, int] | None:
    """``rank``'s record in ``layout``'s newest committed step, read by ``read(step, listed size)`` (never
    more than the manifest lists, at most MAX_BYTES) and checked by ``decode`` against the manifest; None
    where there is no step or no listed record. The layout's and the read's errors are the caller's."""
    steps = layout.committed_steps()
    if not steps:
        return None
    step = steps[-1]
    manifest = layout.read_manifest(step)
    entry = manifest.files.get(side_name(rank))
    if entry is None or entry.size > MAX_BYTES:
        return None
    return decode(read(step, entry.size), manifest.files, rank, directory(step))


def decode(data: bytes, listed: dict[str, Any], rank: int, directory: Path) -> tuple[Record, int] | None:
    """The record in ``data``, ``rank``'s side file as read from a step whose manifest lists ``listed``
    (read at most its listed size, which is at most MAX_BYTES); None unless it matches the listed size and
    crc32c and parses (hostile input: any fault means no record, so the next save writes everything)."""
    entry = listed.get(side_name(rank))
    if entry is None or len(data) != entry.size or crc_hex(crc32c.crc32c(data)) != entry.crc32c:
        return None
    try:
        return _parse(json.loads(data), listed, rank, directory)
    except (ValueError, TypeError, KeyError, RecursionError):  # RecursionError: JSON nested too deep
        return None


def _key(fqn: Any, offset: Any) -> Key:
    if not isinstance(fqn, str) or not isinstance(offset, list):
        raise ValueError("malformed item key")
    if not all(type(o) is int and o >= 0 for o in offset):
        raise ValueError("malformed item offset")
    return fqn, tuple(offset)


def _parse(body: Any, listed: dict[str, Any], rank: int, directory: Path) -> tuple[Record, int]:
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ValueError("not a fingerprint record of this format")
    since_full = body["since_full"]
    if type(since_full) is not int or since_full < 0:
        raise ValueError("malformed since_full")
    fingerprints: dict[Key, bytes] = {}
    for fqn, offset, fp in body["fingerprints"]:
        if not isinstance(fp, str) or not _HEX32.match(fp):
            raise ValueError("malformed fingerprint")
        fingerprints[_key(fqn, offset)] = bytes.fromhex(fp)
    files: dict[str, StoredFile] = {}
    for name, items in body["files"].items():
        entry = listed.get(name)
        # Only this rank's own stable groups, as the manifest lists them (size and crc32c from there).
        if entry is None or not is_stable_group(name) or not name.startswith(f"__{rank}_"):
            raise ValueError(f"{name!r} is not a stable group of rank {rank} in the step")
        infos: dict[Key, tuple[int, int]] = {}
        for fqn, offset, at, length in items:
            if type(at) is not int or type(length) is not int or at < 0 or length < 0:
                raise ValueError("malformed item place")
            if at + length > entry.size:
                raise ValueError("an item lies past the end of its file")
            infos[_key(fqn, offset)] = (at, length)
        if infos:
            files[name] = StoredFile(name, infos, entry.size, entry.crc32c, None)
    return Record(fingerprints, files, {}, directory), since_full
