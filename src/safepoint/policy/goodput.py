"""What checkpointing and failures cost a run, from ROOT's attempts file and run journal (policy/journal.py).

The timeline is cut into attempts (one per manager start, history.py). For each attempt: when it started,
its last sign of life (its recorded end, else the newest journal record or progress of its window), the step
it restored and the last step it reached. Then:

- blocking: seconds the training loop spent inside save calls (``save`` events: the staging copy of an
  async save and the wait for the previous one, the whole of a sync save);
- steps redone: after each restart, the steps between the step restored and the last step the previous
  attempt reached (computed twice); redone seconds: the previous attempt's time after it reached the
  restored step (found from that step's ``save`` event);
- downtime: from one attempt's last sign of life to the next one's start (scheduler, launch, import);
- time lost to restarts: downtime + redone seconds + the restart's restore;
- goodput: the wall time not lost to any of these (blocking, restores, redone work, downtime), as a fraction
  of the wall time from the first start to the last sign of life. Start-up before ``restore()`` and
  anything the job did outside safepoint count as productive: safepoint cannot see them.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import os
from pathlib import Path
from typing import Any

from safepoint import events as ev
from safepoint.errors import CheckpointError
from safepoint.policy.history import RunHistory
from safepoint.policy.journal import CARRY, PROGRESS, read_journal, read_progress
from safepoint.store.posix_layout import Layout
from safepoint.store.rootfs import RootDir

_UNKNOWN_END = {"running"}


@dataclasses.dataclass(slots=True)
class Attempt:
    """One manager start as the report sees it."""

    start: float
    end: float
    outcome: str
    restored: int | None = None
    last_step: int | None = None
    restore_s: float = 0.0
    saves: int = 0
    blocking_s: float = 0.0
    steps_redone: int = 0
    redone_s: float = 0.0
    downtime_s: float = 0.0


@dataclasses.dataclass(slots=True)
class RunReport:
    """The totals ``safepoint report`` prints (and ``--json`` writes, with these names)."""

    root: str
    attempts: list[Attempt]
    records: list[dict[str, Any]]
    skipped_lines: int
    wall_s: float = 0.0
    run_s: float = 0.0
    saves: int = 0
    failed_saves: int = 0
    emergency_saves: int = 0
    preemptions: int = 0
    blocking_s: float = 0.0
    restore_s: float = 0.0
    deleted: int = 0
    bytes_saved: int = 0
    """Bytes the committed saves wrote."""
    bytes_skipped: int = 0
    """Bytes the committed saves linked from an older step instead of writing them (incremental saves)."""
    durable_lag_max_s: float | None = None
    durable_lag_mean_s: float | None = None
    last_durable_step: int | None = None
    last_step: int | None = None

    @property
    def restarts(self) -> int:
        return max(0, len(self.attempts) - 1)

    @property
    def steps_redone(self) -> int:
        return sum(a.steps_redone for a in self.attempts)

    @property
    def redone_s(self) -> float:
        return sum(a.redone_s for a in self.attempts)

    @property
    def downtime_s(self) -> float:
        return sum(a.downtime_s for a in self.attempts)

    @property
    def restart_lost_s(self) -> float:
        """Downtime + redone work + the restores of the restarts (the first start's restore is not a loss
        to a failure)."""
        return self.downtime_s + self.redone_s + sum(a.restore_s for a in self.attempts[1:])

    @property
    def overhead_pct(self) -> float:
        """Loop-blocking save seconds as a percentage of the time the attempts ran."""
        return 100.0 * self.blocking_s / self.run_s if self.run_s > 0 else 0.0

    @property
    def goodput(self) -> float:
        if self.wall_s <= 0:
            return 1.0 if not self.attempts else 0.0
        lost = self.blocking_s + self.restore_s + self.redone_s + self.downtime_s
        return min(1.0, max(0.0, (self.wall_s - lost) / self.wall_s))

    def to_json(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "wall_s": round(self.wall_s, 3),
            "run_s": round(self.run_s, 3),
            "attempts": len(self.attempts),
            "restarts": self.restarts,
            "saves": self.saves,
            "failed_saves": self.failed_saves,
            "emergency_saves": self.emergency_saves,
            "preemptions": self.preemptions,
            "blocking_s": round(self.blocking_s, 6),
            "save_overhead_pct": round(self.overhead_pct, 3),
            "restore_s": round(self.restore_s, 6),
            "downtime_s": round(self.downtime_s, 3),
            "redone_s": round(self.redone_s, 3),
            "time_lost_to_restarts_s": round(self.restart_lost_s, 3),
            "steps_redone": self.steps_redone,
            "last_step": self.last_step,
            "last_durable_step": self.last_durable_step,
            "durability_lag_max_s": _round(self.durable_lag_max_s),
            "durability_lag_mean_s": _round(self.durable_lag_mean_s),
            "deleted": self.deleted,
            "bytes_saved": self.bytes_saved,
            "bytes_skipped": self.bytes_skipped,
            "goodput": round(self.goodput, 4),
            "skipped_lines": self.skipped_lines,
            "attempt_list": [
                {k: _round(v) if isinstance(v, float) else v for k, v in dataclasses.asdict(a).items()}
                for a in self.attempts
            ],
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def analyze(
    root: str,
    attempts: list[dict[str, Any]],
    records: list[dict[str, Any]],
    skipped: int,
    progress: tuple[int, float] | None,
) -> RunReport:
    """The report of a run: ``attempts`` (history.py, validated), ``records`` (the journal, validated),
    ``progress`` (the progress file: the last step of an attempt that neither closed nor was followed)."""
    records = sorted(records, key=lambda r: r["wall_time"])
    if progress is not None:
        records.append({"event_type": PROGRESS, "step": progress[0], "wall_time": progress[1]})
    starts = sorted((a for a in attempts), key=lambda a: float(a["start"]))
    if not starts and records:  # a journal without its attempts file: one attempt, as far as known
        starts = [{"start": records[0]["wall_time"], "end": None, "outcome": "running"}]
    report = RunReport(root, [], records, skipped)
    windows: list[list[dict[str, Any]]] = [[] for _ in starts]
    bounds = [float(a["start"]) for a in starts]
    for r in records:
        i = max(0, _last_le(bounds, r["wall_time"]))
        if windows:
            windows[i].append(r)
    for a, window in zip(starts, windows, strict=True):
        report.attempts.append(_attempt(a, window))
    _restarts(report, records)
    _totals(report, records)
    return report


def _last_le(bounds: list[float], t: float) -> int:
    i = -1
    for j, b in enumerate(bounds):
        if b <= t:
            i = j
    return i


def _attempt(a: dict[str, Any], window: list[dict[str, Any]]) -> Attempt:
    start = float(a["start"])
    seen = [r["wall_time"] for r in window if r["event_type"] != CARRY]
    end = a.get("end") if a.get("outcome") not in _UNKNOWN_END and not a.get("inferred") else None
    last = max([start, *seen, *([float(end)] if end is not None else [])])
    out = Attempt(start=start, end=last, outcome=str(a.get("outcome") or "running"))
    steps = []
    for r in window:
        kind = r["event_type"]
        if kind == ev.RESTORE and out.restored is None:
            out.restored = r.get("step")
            out.restore_s = float(r.get("duration_secs", 0.0))
        elif kind == ev.SAVE:
            out.saves += 1
            out.blocking_s += float(r.get("checkpoint_manager_blocking_duration_secs", 0.0))
        if kind in (PROGRESS, ev.SAVE, ev.RESTORE) and r.get("step") is not None:
            steps.append(int(r["step"]))
    out.last_step = max(steps) if steps else None
    if a.get("outcome") == "running" or a.get("inferred"):
        out.outcome = "killed" if a.get("inferred") else "running or killed"
    return out


def _reached(records: list[dict[str, Any]], step: int, before: float) -> float | None:
    """When the loop reached ``step`` (its save started), before ``before``."""
    times = [
        float(r.get("checkpoint_manager_blocking_start_time", r["wall_time"]))
        + float(r.get("wait_for_prev_duration_secs", 0.0))
        for r in records
        if r["event_type"] == ev.SAVE and r.get("step") == step and r["wall_time"] <= before
    ]
    return max(times) if times else None


def _restarts(report: RunReport, records: list[dict[str, Any]]) -> None:
    for prev, cur in zip(report.attempts, report.attempts[1:], strict=False):
        cur.downtime_s = max(0.0, cur.start - prev.end)
        restored = cur.restored if cur.restored is not None else 0
        if prev.last_step is not None and prev.last_step > restored:
            cur.steps_redone = prev.last_step - restored
            reached = _reached(records, restored, prev.end) if restored else prev.start
            if reached is None:
                reached = prev.start if restored == 0 else None
            cur.redone_s = max(0.0, prev.end - reached) if reached is not None else 0.0


def _totals(report: RunReport, records: list[dict[str, Any]]) -> None:
    if report.attempts:
        report.wall_s = max(a.end for a in report.attempts) - report.attempts[0].start
        report.run_s = sum(a.end - a.start for a in report.attempts)
        steps = [a.last_step for a in report.attempts if a.last_step is not None]
        report.last_step = max(steps) if steps else None
    lags = []
    for r in records:
        kind = r["event_type"]
        if kind == CARRY:
            report.saves += int(r.get("saves", 0))
            report.failed_saves += int(r.get("failures", 0))
            report.blocking_s += float(r.get("blocking_s", 0.0))
            report.restore_s += float(r.get("restore_s", 0.0))
            report.deleted += int(r.get("deleted", 0))
            report.bytes_saved += int(r.get("bytes", 0))
            report.bytes_skipped += int(r.get("skipped", 0))
        elif kind == ev.SAVE_COMMITTED:
            report.saves += 1
            report.bytes_saved += int(r.get("bytes_written", 0))
            report.bytes_skipped += int(r.get("bytes_skipped", 0))
        elif kind == ev.SAVE:
            report.blocking_s += float(r.get("checkpoint_manager_blocking_duration_secs", 0.0))
        elif kind == ev.SAVE_FAILED:
            report.failed_saves += 1
        elif kind == ev.RESTORE:
            report.restore_s += float(r.get("duration_secs", 0.0))
        elif kind == ev.SAVE_DELETED:
            report.deleted += 1
        elif kind == ev.PREEMPTION:
            report.preemptions += 1
        elif kind == ev.EMERGENCY_SAVE and r.get("step") is not None:
            report.emergency_saves += 1
        elif kind == ev.SAVE_DURABLE and r.get("step") is not None:
            lags.append(float(r.get("lag_secs", 0.0)))
            report.last_durable_step = max(report.last_durable_step or 0, int(r["step"]))
    if lags:
        report.durable_lag_max_s = max(lags)
        report.durable_lag_mean_s = math.fsum(lags) / len(lags)


# ---- reading a root, and the report as text ------------------------------------------------------------


def build_report(root: str | os.PathLike[str]) -> RunReport:
    """The report of the run in the local ``root`` (CheckpointError if it is not a readable directory)."""
    where = os.fspath(root)
    if "://" in where and not where.startswith("file://"):
        raise CheckpointError(
            f"{where}: a URL root's run journal is read by the CLI, from its .run/ objects: run "
            "`safepoint report URL`"
        )
    path = Path(where.removeprefix("file://"))
    if not RootDir(path).isdir("") or path.is_symlink():
        raise CheckpointError(f"{path} is not a checkpoint root (no such directory)")
    # The attempts file is read as at a manager's start (validated; unreadable: none), without its warning
    # that "the restart history starts over", which is about a start, not a report.
    history = logging.getLogger("safepoint")
    level = history.level
    history.setLevel(logging.ERROR)
    try:
        attempts = RunHistory(Layout(path))._load()
    finally:
        history.setLevel(level)
    try:
        records, skipped = read_journal(path)
    except OSError as e:
        raise CheckpointError(f"cannot read the run journal of {path}: {e}") from None
    return analyze(str(path), attempts, records, skipped, read_progress(path))


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _seconds(s: float) -> str:
    if s < 120:
        return f"{s:.2f}s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"


def report_lines(r: RunReport) -> list[str]:
    """The report as text (what `safepoint report` and the demo print)."""
    if not r.attempts:
        return [f"no run recorded in {r.root} (no attempts file or run journal: no manager owned it yet)"]
    first, last = r.attempts[0].start, max(a.end for a in r.attempts)
    lost = (
        f"{_seconds(r.restart_lost_s)}: {_seconds(r.downtime_s)} down, {_seconds(r.redone_s)} redoing "
        f"{r.steps_redone} step(s), {_seconds(sum(a.restore_s for a in r.attempts[1:]))} restoring"
    )
    rows = [
        ("run", f"{_when(first)} -> {_when(last)}  ({_seconds(r.wall_s)} wall, {_seconds(r.run_s)} running)"),
        ("attempts", f"{len(r.attempts)} ({r.restarts} restart(s))"),
        ("saves", f"{r.saves} committed, {r.failed_saves} failed, {r.emergency_saves} emergency"),
        ("bytes", f"{r.bytes_saved / 1e6:.1f} MB written, {r.bytes_skipped / 1e6:.1f} MB linked instead"),
        ("loop blocked by saves", f"{_seconds(r.blocking_s)} ({r.overhead_pct:.2f}% of the running time)"),
        ("restores", _seconds(r.restore_s)),
        ("lost to restarts", lost),
        ("steps redone", str(r.steps_redone)),
        ("durability lag", _lag(r)),
        ("goodput", f"{100 * r.goodput:.1f}% of the wall time"),
    ]
    out = [f"safepoint report {r.root}", *(f"  {name:<22} {value}" for name, value in rows), "  attempts:"]
    for i, a in enumerate(r.attempts):
        restored = "fresh start" if not a.restored else f"restored step {a.restored}"
        redo = f", {a.steps_redone} step(s) redone" if a.steps_redone else ""
        reached = "-" if a.last_step is None else str(a.last_step)
        took = _seconds(a.end - a.start)
        out.append(
            f"    {i + 1}. {_when(a.start)}  {took:>9}  {restored}, reached step {reached}, "
            f"{a.saves} save(s){redo}; {a.outcome}"
        )
    if r.skipped_lines:
        out.append(f"  {r.skipped_lines} malformed journal line(s) skipped")
    return out


def _lag(r: RunReport) -> str:
    if r.durable_lag_max_s is None:
        return "no durable copy recorded"
    text = f"max {_seconds(r.durable_lag_max_s)}, mean {_seconds(r.durable_lag_mean_s or 0.0)}"
    if r.last_step is not None and r.last_durable_step is not None:
        text += f"; at the end {max(0, r.last_step - r.last_durable_step)} step(s) not durable"
    return text
