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

        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise bad(f"manifest is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise bad("manifest is not a JSON object")
        if body.get("format") != FORMAT_NAME:
            raise bad(f"not a safepoint manifest (format={body.get('format')!r})")
        version = body.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise bad(
                f"manifest format_version {version!r} is newer than this safepoint understands "
                f"({FORMAT_VERSION}); upgrade safepoint"
            )
        stored = body.pop(_SELF_CRC_KEY, None)
        if stored != _body_crc(body):
            raise bad("manifest checksum mismatch (the manifest itself is damaged)")
        try:
            files = _parse_files(body["files"])
            manifest = cls(
                step=int(body["step"]),
                files=files,
                world_size=int(body["world_size"]),
                time=float(body["time"]),
                metrics={str(k): float(v) for k, v in body.get("metrics", {}).items()},
                keys=[str(k) for k in body.get("keys", [])],
                save_id=str(body.get("save_id", "")),
                host=str(body.get("host", "")),
                versions={str(k): str(v) for k, v in body.get("versions", {}).items()},
                extra=dict(body.get("extra", {})),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise bad(f"manifest is missing or has a malformed field ({e!r})") from None
        if problem := _listing_problem(files):
            raise bad(problem)
        if not _SAVE_ID.fullmatch(manifest.save_id):
            # It names directories under .pending (a node's received files, a restore's downloads): a
            # "../x" from a hostile manifest must never become a path.
            raise bad(f"manifest save_id {manifest.save_id[:80]!r} is not a plain id")
        if step_hint is not None and manifest.step != step_hint:
            raise bad(f"manifest says step {manifest.step} but the directory is for step {step_hint}")
        return manifest


def _parse_files(listed: Any) -> dict[str, FileEntry]:
    """The manifest's {name: FileEntry}; raises TypeError/ValueError for malformed entries."""
    if not isinstance(listed, dict):
        raise TypeError(f"files is a {type(listed).__name__}, not an object")
    files = {}
    for name, e in listed.items():
        size = e["size"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"file {name!r}: size {size!r} is not a non-negative integer")
        files[name] = FileEntry(size=size, crc32c=str(e["crc32c"]), parts=_parse_parts(name, size, e))
    return files


def _parse_parts(name: str, size: int, entry: dict[str, Any]) -> Parts | None:
    if "parts" not in entry:
        return None
    psize, crcs = entry["parts"]["size"], entry["parts"]["crc32c"]
    if not isinstance(psize, int) or isinstance(psize, bool) or psize < 1 or not isinstance(crcs, list):
        raise ValueError(f"file {name!r}: malformed parts {entry['parts']!r}")
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
