"""The run journal: ``ROOT/.journal.jsonl``, what the saves, restores and failures of a run cost, for
``safepoint report``. It lives beside the attempts file (history.py: one record per manager start, how it
ended), which the report reads with it: the attempts are kept there once, not twice.

Written by rank 0 of the manager that holds the root's lease, and by nothing else: one JSON line per event
of rank 0 (events.py; the phases the report needs, see ``JOURNALED``), appended (O_APPEND, never rewritten
in place) outside the root's checkpoints, so retention never deletes it and every restart appends to the
same file. Bounded: past ``MAX_JOURNAL_BYTES`` the older half is folded into one ``carry`` record (counts
and sums) and the file is replaced atomically (temporary file, fsync, rename), so totals survive and the
file stays under the cap whatever the run's length.

``ROOT/.progress`` holds the last step the training loop reached (``maybe_save`` writes it in place, one
fixed-size record, no fsync: a killed process's write is in the page cache). The next owner appends it to
the journal before its own first step: that is how the report knows the steps a kill made the job compute
again. Both files are advisory: a write that fails is logged once and the journal stops; training goes on.

Reading: both files are read as hostile input, like every file of a root (regular files only, never
through a symlink, bounded size; each line validated: a JSON object of the expected types, finite numbers;
a bad line is skipped and counted, never a traceback).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import mmap
import os
import time
from pathlib import Path
from typing import Any

from safepoint import events as ev
from safepoint.dist import Comm
from safepoint.policy.history import RunHistory
from safepoint.store.guard import read_regular
from safepoint.store.posix_layout import CheckpointStore, Layout
from safepoint.store.rootfs import RootDir

log = logging.getLogger("safepoint")
JOURNAL_NAME = ".journal.jsonl"
PROGRESS_NAME = ".progress"
MAX_JOURNAL_BYTES = 4 << 20
MAX_LINE_BYTES = 4096
_PROGRESS_BYTES = 128  # one fixed-size record, rewritten in place
PROGRESS, CARRY = "progress", "carry"
JOURNALED = frozenset({
    ev.SAVE, ev.SAVE_COMMITTED, ev.SAVE_DURABLE, ev.SAVE_DELETED, ev.SAVE_FAILED,
    ev.RESTORE, ev.RESTORE_FALLBACK, ev.PREEMPTION, ev.EMERGENCY_SAVE,
})  # fmt: skip
_KINDS = JOURNALED | {PROGRESS, CARRY}
# json.dumps(record, sort_keys=True), with its encoder made once (dumps makes one per call for sort_keys).
_ENCODE = json.JSONEncoder(sort_keys=True).encode
_NUMBERS = frozenset(
    f.name for f in dataclasses.fields(ev.CheckpointEvent) if f.name.endswith(("_secs", "_time", "_sec"))
) | {"bytes_written", "bytes_skipped", "wall_time"}
_TEXTS = frozenset({"tier", "directory", "reason", "event_type"})
_FLAGS = frozenset({"is_async", "emergency"})
# carry: the sums the report needs of the records folded away.
_CARRIED = (
    "saves", "failures", "blocking_s", "restores", "restore_s", "deleted", "bytes", "skipped", "first_time"
)  # fmt: skip


class Journal:
    """Rank 0's writer (an event sink): appends rank 0's events and the loop's progress to ROOT's files."""

    event_types = JOURNALED
    """The events it reads (events.Events builds no other event for it: two of a save's six)."""

    def __init__(self, root: Path | None, *, max_bytes: int = MAX_JOURNAL_BYTES) -> None:
        """Touches nothing before :meth:`open`; unopened (or ``root`` None: no local root), every call
        is a no-op (a manager that does not own the root, or a rank other than 0, never opens one)."""
        root = root if root is not None else Path("/nonexistent")
        self.fs = RootDir(root)  # ROOT's own files, never through a symlink (store/rootfs.py)
        self.path, self.progress_path = root / JOURNAL_NAME, root / PROGRESS_NAME
        self.max_bytes = max_bytes
        self._fd: int | None = None
        self._progress: mmap.mmap | None = None
        self._step: int | None = None
        self._broken = False

    def open(self) -> None:
        """At the manager's start (lease held): the previous attempt's last progress goes in the journal."""
        previous = read_progress(self.progress_path.parent)
        if previous is not None:
            self._append({"event_type": PROGRESS, "step": previous[0], "wall_time": previous[1]})
        self._guarded(lambda: self._open_progress())

    def _open_progress(self) -> None:
        # A shared mapping of the file's one page: recording a step is a memory copy, no system call (a
        # pwrite per step measured ~4x maybe_save's own cost), and what a killed process copied in is in
        # the page cache, where the next owner reads it.
        fd = self.fs.open_write(PROGRESS_NAME, append=False)
        try:
            os.ftruncate(fd, _PROGRESS_BYTES)
            self._progress = mmap.mmap(fd, _PROGRESS_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    def __call__(self, event: ev.CheckpointEvent) -> None:
        if event.rank == 0 and event.event_type in JOURNALED:
            self._append(event.to_dict())

    def progress(self, step: int) -> None:
        """The loop reached ``step`` (every maybe_save): a fixed-size record copied into the mapped file."""
        if step == self._step or self._progress is None:
            return
        self._step = step
        ms = time.time_ns() // 1_000_000  # integers: a float's formatting costs more than the rest
        line = b'{"step": %d, "wall_time": %d.%03d}' % (step, ms // 1000, ms % 1000)
        self._progress[:] = line.ljust(_PROGRESS_BYTES - 1) + b"\n"  # a torn copy fails validation: ignored

    def close(self) -> None:
        """At the manager's close: the last step reached is journaled now (the next start finds none)."""
        if self._step is not None:
            self._append({"event_type": PROGRESS, "step": self._step, "wall_time": round(time.time(), 3)})
        if self._fd is not None:
            os.close(self._fd)
        if self._progress is not None:  # opened by this manager: journaled above, or no step was reached
            self._progress.close()
            with contextlib.suppress(OSError):
                self.fs.remove(PROGRESS_NAME)
        self._fd, self._progress = None, None

    def _guarded(self, write: Any) -> None:
        if self._broken:
            return
        try:
            write()
        except OSError as e:  # advisory: the journal stops, training does not
            self._broken = True
            log.warning(
                "safepoint: the run journal in %s stops (%s); `safepoint report` misses the rest",
                self.path.parent, e,
            )  # fmt: skip

    def _append(self, record: dict[str, Any]) -> None:
        line = (_ENCODE(record) + "\n").encode()
        if len(line) > MAX_LINE_BYTES:  # a reason too long to keep: shortened, the line stays valid
            record["reason"] = str(record.get("reason", ""))[:500]
            line = (_ENCODE(record) + "\n").encode()

        def write() -> None:
            if self._fd is None:
                self._fd = self.fs.open_write(JOURNAL_NAME)
            if os.fstat(self._fd).st_size + len(line) > self.max_bytes:
                self._compact()
            os.write(self._fd, line)

        self._guarded(write)

    def _compact(self) -> None:
        """Fold the older half into one carry record; replace the file atomically (crash: old or new)."""
        records, _ = parse_journal(read_regular(self.path, 2 * self.max_bytes))
        keep = records[len(records) // 2 :]
        carry = fold_carry(records[: len(records) // 2])
        lines = [json.dumps(r, sort_keys=True) for r in [carry, *keep]]
        tmp = f"{JOURNAL_NAME}.tmp"
        self.fs.write(tmp, ("\n".join(lines) + "\n").encode())  # fsync'd
        self.fs.move(tmp, JOURNAL_NAME)
        self.fs.fsync_dir()
        if self._fd is not None:
            os.close(self._fd)
        self._fd = self.fs.open_write(JOURNAL_NAME)


def open_records(
    layout: CheckpointStore, comm: Comm, read_only: object, events: ev.Events
) -> tuple[RunHistory | None, Journal]:
    """At a manager's start: rank 0 of the root's owner records this attempt in the attempts file
    (history.py) and opens the journal, subscribed to the manager's events. Elsewhere: no history, and a
    journal that is never opened (its ``progress``/``close`` do nothing)."""
    if not isinstance(layout, Layout):  # an object store root has no local disk for them (docs/goodput.md)
        return None, Journal(None)
    journal = Journal(layout.root)
    if not comm.is_coordinator or read_only:
        return None, journal
    runs = RunHistory(layout)
    runs.begin()
    journal.open()
    events.subscribe(journal)
    return runs, journal


def fold_carry(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The sums the report needs of ``records`` (a carry among them included), as one carry record."""
    out: dict[str, Any] = dict.fromkeys(_CARRIED, 0)
    out["first_time"] = None
    for r in records:
        kind = r["event_type"]
        if kind == CARRY:
            for k in _CARRIED[:-1]:
                out[k] += r.get(k, 0)
        elif kind == ev.SAVE_COMMITTED:
            out["saves"] += 1
            out["bytes"] += r.get("bytes_written", 0)
            out["skipped"] += r.get("bytes_skipped", 0)
        elif kind == ev.SAVE:
            out["blocking_s"] += r.get("checkpoint_manager_blocking_duration_secs", 0.0)
        elif kind == ev.SAVE_FAILED:
            out["failures"] += 1
        elif kind == ev.RESTORE:
            out["restores"] += 1
            out["restore_s"] += r.get("duration_secs", 0.0)
        elif kind == ev.SAVE_DELETED:
            out["deleted"] += 1
        first = r.get("first_time", r.get("wall_time"))
        if first is not None and (out["first_time"] is None or first < out["first_time"]):
            out["first_time"] = first
    out["blocking_s"], out["restore_s"] = round(out["blocking_s"], 6), round(out["restore_s"], 6)
    return {"event_type": CARRY, "wall_time": out["first_time"] or 0.0, **out}


# ---- reading (hostile input) ---------------------------------------------------------------------------


def _number(x: Any) -> bool:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    return (math.isfinite(x) if isinstance(x, float) else abs(x) < 2**53) and x >= 0


def valid_record(r: Any) -> bool:
    """A journal line as the report reads it: known kind, finite non-negative numbers, the expected types."""
    if not isinstance(r, dict) or r.get("event_type") not in _KINDS or not _number(r.get("wall_time")):
        return False
    step = r.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 2**63):
        return False
    for key, value in r.items():
        if key in _NUMBERS or key in _CARRIED:
            if not (value is None and key == "first_time") and not _number(value):
                return False
        elif (
            (key in _TEXTS and not isinstance(value, str))
            or (key in _FLAGS and not isinstance(value, bool))
            or (key == "rank" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0))
        ):
            return False
    return True


def parse_journal(raw: bytes) -> tuple[list[dict[str, Any]], int]:
    """(the valid records in order, how many lines were skipped as malformed)."""
    records, skipped = [], 0
    for line in raw.splitlines():
        if not line.strip():
            continue
        try:
            if len(line) > MAX_LINE_BYTES:
                raise ValueError("line too long")
            record = json.loads(line)
        except (ValueError, RecursionError):
            skipped += 1
            continue
        if valid_record(record):
            records.append(record)
        else:
            skipped += 1
    return records, skipped


def read_journal(root: Path, limit: int = 2 * MAX_JOURNAL_BYTES) -> tuple[list[dict[str, Any]], int]:
    """ROOT's journal: (records, lines skipped); none if there is no journal. OSError if it is not a
    regular file or larger than ``limit`` (a planted file is not read without bound)."""
    try:
        raw = read_regular(root / JOURNAL_NAME, limit)
    except FileNotFoundError:
        return [], 0
    return parse_journal(raw)


def read_progress(root: Path) -> tuple[int, float] | None:
    """(step, wall time) the loop last reached, from ROOT's progress file; None if absent or malformed."""
    try:
        raw = read_regular(root / PROGRESS_NAME, 4 * _PROGRESS_BYTES)
        record = json.loads(raw)
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(record, dict):
        return None
    record["event_type"] = PROGRESS
    if not valid_record(record) or record.get("step") is None:
        return None
    return int(record["step"]), float(record["wall_time"])
