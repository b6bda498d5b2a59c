"""Rebuild, in the parent, the tree a power loss at the crash point could leave (from faults.py's journal).

The model is the POSIX durability contract, applied strictly:
- a file's contents are what they were at its last fsync (the baseline if never fsynced since; empty if
  created and never fsynced);
- a directory's entries are what they were at its last fsync (baseline / empty likewise): a create,
  rename or unlink in a directory is lost unless that directory was fsynced afterwards.

Two roll-backs are offered:
    "power"  both rules (everything not fsynced is lost)
    "data"   file contents only; the namespace is left as the crash left it (metadata journalled, data
             not: the ext4 ``data=writeback`` / delayed-allocation case that turns renamed files empty)
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

from tests.torture.faults import ADVISORY

Ident = tuple[int, int]  # (inode, generation)


@dataclasses.dataclass
class Journal:
    events: list[dict[str, Any]]
    scope: str
    scope_ident: Ident
    gen: dict[int, int]  # inode -> its generation at the end (the crash)
    dirs: dict[Ident, list[tuple[str, Ident, bool]]]  # last fsynced entries
    files: dict[Ident, Path]  # last fsynced contents (a copy)
    unknown: list[str]  # entries whose inode was created by an operation the layer did not see

    @property
    def ops(self) -> list[dict[str, Any]]:
        """Every counted operation, with "state": done / err / crash / fail / open (never finished)."""
        by_i: dict[int, dict[str, Any]] = {}
        for ev in self.events:
            if ev["ev"] == "op":
                by_i[ev["i"]] = dict(ev, state="open")
            elif ev["ev"] in ("done", "err", "crash", "fail"):
                by_i[ev["i"]]["state"] = ev["ev"]
        return [by_i[i] for i in sorted(by_i)]


def read(journal_dir: Path) -> Journal:
    events = [json.loads(line) for line in (journal_dir / "journal.jsonl").read_text().splitlines()]
    gen: dict[int, int] = {}
    dirs: dict[Ident, list[tuple[str, Ident, bool]]] = {}
    files: dict[Ident, Path] = {}
    unknown: list[str] = []
    scope, scope_ino = "", 0
    baseline_done = False
    for ev in events:
        kind = ev["ev"]
        if kind == "scope":
            scope, scope_ino = ev["path"], ev["ino"]
        elif kind == "new":
            gen[ev["ino"]] = ev["gen"]
        elif kind == "dir":
            entries = []
            for name, ino, g, is_dir in ev["entries"]:
                if g < 0:
                    unknown.append(f"{name} (inode {ino})")
                entries.append((name, (ino, g), is_dir))
            dirs[(ev["ino"], ev["gen"])] = entries
            if not baseline_done:
                gen.setdefault(ev["ino"], 0)
                for _, ino, _, _ in ev["entries"]:
                    gen.setdefault(ino, 0)
        elif kind == "file":
            files[(ev["ino"], ev["gen"])] = journal_dir / "blobs" / str(ev["blob"])
        elif kind == "op":
            baseline_done = True
    return Journal(events, scope, (scope_ino, 0), gen, dirs, files, unknown)


def _write_file(j: Journal, ident: Ident, dst: Path) -> None:
    blob = j.files.get(ident)
    if blob is None:
        dst.write_bytes(b"")  # created, never fsynced: nothing of it is durable
    else:
        shutil.copyfile(blob, dst)


def rebuild_power(j: Journal, out: Path) -> None:
    """Write the tree a power loss would leave into ``out`` (which stands for ``j.scope``)."""

    def build(ident: Ident, dst: Path, depth: int) -> None:
        assert depth < 64, "directory cycle in the durable model"
        for name, child, is_dir in j.dirs.get(ident, []):
            target = dst / name
            if is_dir:
                target.mkdir()
                build(child, target, depth + 1)
            else:
                _write_file(j, child, target)

    out.mkdir(parents=True)
    build(j.scope_ident, out, 0)


def rebuild_data(j: Journal, out: Path) -> None:
    """The namespace as the crash left it, every file's contents rolled back to its last fsync."""
    src_root = Path(j.scope)
    out.mkdir(parents=True)
    for dirpath, dirnames, filenames in os.walk(src_root):
        rel = Path(dirpath).relative_to(src_root)
        for name in dirnames:
            (out / rel / name).mkdir()
        for name in filenames:
            if name in ADVISORY:
                continue  # not modelled (faults.py)
            ino = os.lstat(os.path.join(dirpath, name)).st_ino
            if ino not in j.gen:
                j.unknown.append(str(rel / name))
            _write_file(j, (ino, j.gen.get(ino, -1)), out / rel / name)
