"""The manifest ``safepoint.json``: written last, it is what makes a directory a checkpoint.

It lists every file with its size and crc32c and carries a checksum of its own body, so a flipped byte in
the manifest itself is caught too (JSON that still parses is not proof that it is intact).
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import re
import socket
import time
from typing import Any

import crc32c
import torch

from safepoint._version import __version__
from safepoint.errors import CorruptCheckpointError
from safepoint.store.checksum import crc_hex
from safepoint.store.guard import bare_name_problem
from safepoint.store.records import (
    MAX_INT,
    CorruptRecordError,
    checked_float,
    dict_field,
    float_field,
    int_field,
    list_field,
    parse_object,
    shown,
    str_field,
)
from safepoint.store.storage import METADATA_NAME

MANIFEST_NAME = "safepoint.json"
_HEX8 = re.compile("[0-9a-f]{8}")
FORMAT_NAME = "safepoint-checkpoint"
FORMAT_VERSION = 1
_SELF_CRC_KEY = "manifest_crc32c"
# manifest.extra[ORIGIN_KEY]: how a checkpoint came to be ("import" = made by `safepoint import`).
ORIGIN_KEY = "origin"
ORIGIN_IMPORT = "import"
_SAVE_ID = re.compile(r"[0-9A-Za-z_-]{0,64}")
MAX_TIME = 1e11
"""Latest manifest ``time`` accepted (the year 5138): 2**63 would overflow ``datetime`` in ``ls``."""
MAX_WORLD_SIZE = 2**24


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Parts:
    """How an object went up to a store in parts, and each part's crc32c: what lets a store's *composite*
    checksum (S3's crc32c of the parts' crc32cs, "-<count>") be checked against the file's own crc32c
    without reading the object (remote/s3read.py)."""

    size: int
    """Every part's length but the last one's (which holds the rest)."""
    crc32c: tuple[str, ...]
    """Each part's crc32c (hex), in order."""


@dataclasses.dataclass(kw_only=True, slots=True)
class FileEntry:
    size: int
    crc32c: str
    parts: Parts | None = None
    """Recorded by an upload in parts with a composite checksum (absent from local manifests)."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"size": self.size, "crc32c": self.crc32c}
        if self.parts is not None:
            out["parts"] = {"size": self.parts.size, "crc32c": list(self.parts.crc32c)}
        return out


@dataclasses.dataclass(kw_only=True, slots=True)
class Manifest:
    """Everything safepoint knows about one committed checkpoint."""

    step: int
    """Optimizer steps completed when the state was captured."""
    files: dict[str, FileEntry]
    """Every file of the checkpoint (relative name) with its size and crc32c."""
    world_size: int = 1
    time: float = dataclasses.field(default_factory=time.time)
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    keys: list[str] = dataclasses.field(default_factory=list)
    """Top-level state sections present (model, optimizer, ...)."""
    save_id: str = ""
    host: str = dataclasses.field(default_factory=socket.gethostname)
    versions: dict[str, str] = dataclasses.field(
        default_factory=lambda: {
            "safepoint": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        }
    )
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Free-form facts other components record (timings, tier, ...)."""

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def expected(self) -> dict[str, tuple[int, str]]:
        """{file: (size, crc32c)}: what a reader checks the bytes it reads against."""
        return {name: (e.size, e.crc32c) for name, e in self.files.items()}

    def with_parts(self, parts: dict[str, Parts]) -> Manifest:
        """A copy whose entries carry ``parts`` ({file name: how it went up this time}; others none: a part
        record copied from another store's manifest would not describe this upload); the rest unchanged."""
        files = {n: dataclasses.replace(e, parts=parts.get(n)) for n, e in self.files.items()}
        return dataclasses.replace(self, files=files)

    def to_json(self) -> bytes:
        body: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "time": self.time,
            "world_size": self.world_size,
            "metrics": self.metrics,
            "keys": self.keys,
            "save_id": self.save_id,
            "host": self.host,
            "versions": self.versions,
            "extra": self.extra,
            "files": {k: v.to_json() for k, v in sorted(self.files.items())},
        }
        body[_SELF_CRC_KEY] = _body_crc(body)
        return (json.dumps(body, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, *, step_hint: int | None = None) -> Manifest:
        """Parse and self-verify a manifest; raise CorruptCheckpointError naming what is wrong."""

        def bad(reason: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(step_hint, MANIFEST_NAME, reason)

        what = f"step {step_hint} manifest" if step_hint is not None else "manifest"
        try:
            body = parse_object(data, what)
        except CorruptRecordError as e:
            raise bad(e.reason) from None
        if body.get("format") != FORMAT_NAME:
            raise bad(f"not a safepoint manifest (format={shown(body.get('format'))})")
        version = body.get("format_version")
        if type(version) is not int or version > FORMAT_VERSION:
            raise bad(
                f"manifest format_version {shown(version)} is newer than this safepoint understands "
                f"({FORMAT_VERSION}); upgrade safepoint"
            )
        stored = body.pop(_SELF_CRC_KEY, None)
        if stored != _body_crc(body):
            raise bad("manifest checksum mismatch (the manifest itself is damaged)")
        try:
            files = _parse_files(dict_field(body, "files", what))
            manifest = cls(
                step=int_field(body, "step", what),
                files=files,
                world_size=int_field(body, "world_size", what, lo=1, hi=MAX_WORLD_SIZE),
                time=float_field(body, "time", what, lo=0.0, hi=MAX_TIME),
                metrics={
                    str(k): checked_float(v, f"metrics[{shown(k)}]", what, lo=-math.inf, hi=math.inf)
                    for k, v in dict_field(body, "metrics", what, default={}).items()
                },
                keys=[_plain(k, "keys") for k in list_field(body, "keys", what, default=[])],
                save_id=str_field(body, "save_id", what, default=""),
                host=str_field(body, "host", what, default=""),
                versions={
                    str(k): _plain(v, "versions")
                    for k, v in dict_field(body, "versions", what, default={}).items()
                },
                extra=dict(dict_field(body, "extra", what, default={})),
            )
        except CorruptRecordError as e:
            raise bad(f"manifest has a malformed field ({e.reason})") from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise bad(f"manifest is missing or has a malformed field ({shown(e)})") from None
        if problem := _listing_problem(files):
            raise bad(problem)
        if not _SAVE_ID.fullmatch(manifest.save_id):
            # It names directories under .pending (a node's received files, a restore's downloads): a
            # "../x" from a hostile manifest must never become a path.
            raise bad(f"manifest save_id {manifest.save_id[:80]!r} is not a plain id")
        if step_hint is not None and manifest.step != step_hint:
            raise bad(f"manifest says step {manifest.step} but the directory is for step {step_hint}")
        return manifest


def _plain(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{field} holds {shown(value)}, not a string")
    return value


def _parse_files(listed: dict[str, Any]) -> dict[str, FileEntry]:
    """The manifest's {name: FileEntry}; raises TypeError/ValueError for malformed entries."""
    files = {}
    for name, e in listed.items():
        if not isinstance(e, dict):
            raise ValueError(f"file {shown(name)}: entry {shown(e)} is not an object")
        size = e["size"]
        if type(size) is not int or not 0 <= size <= MAX_INT:
            raise ValueError(f"file {shown(name)}: size {shown(size)} is not an integer in [0, {MAX_INT}]")
        files[name] = FileEntry(size=size, crc32c=str(e["crc32c"]), parts=_parse_parts(name, size, e))
    return files


def _parse_parts(name: str, size: int, entry: dict[str, Any]) -> Parts | None:
    if "parts" not in entry:
        return None
    parts = entry["parts"]
    psize, crcs = (parts.get("size"), parts.get("crc32c")) if isinstance(parts, dict) else (None, None)
    if type(psize) is not int or not 1 <= psize <= MAX_INT or not isinstance(crcs, list):
        raise ValueError(f"file {shown(name)}: malformed parts {shown(parts)}")
    if len(crcs) != max(1, -(-size // psize)) or not all(_HEX8.fullmatch(str(c)) for c in crcs):
        raise ValueError(f"file {name!r}: {len(crcs)} part checksums do not fit {size} bytes in {psize}")
    return Parts(size=psize, crc32c=tuple(str(c) for c in crcs))


def _listing_problem(files: dict[str, FileEntry]) -> str | None:
    """Why the file list cannot be a checkpoint's: a name that is not a bare file name (``../x``, ``/etc``,
    ``a/b``) would make verify read outside the checkpoint; no ``.metadata`` or no data file is no DCP
    checkpoint at all (an empty list would otherwise verify trivially)."""
    for name in files:
        if problem := bare_name_problem(name):
            return f"manifest lists {problem}"
    if MANIFEST_NAME in files:
        return "manifest lists itself"
    if METADATA_NAME not in files:
        return f"manifest does not list {METADATA_NAME} (not a DCP checkpoint)"
    if len(files) < 2:
        return "manifest lists no data file"
    return None


def clean_metrics(metrics: dict[str, Any] | None) -> dict[str, float]:
    """Validate user metrics: finite numbers only (tensors of one element are accepted)."""
    out: dict[str, float] = {}
    for k, v in (metrics or {}).items():
        if isinstance(v, torch.Tensor):
            v = v.detach().float().item()
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"metrics[{k!r}] must be a number, got {type(v).__name__}") from None
        if not math.isfinite(f):
            # JSON cannot hold NaN/inf portably; record it as missing rather than fail the save.
            continue
        out[str(k)] = f
    return out


def _body_crc(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return crc_hex(crc32c.crc32c(canonical))
