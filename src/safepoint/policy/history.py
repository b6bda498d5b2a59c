"""The run's history: save timings read from manifests, upload timings (tiering), and the attempts file
behind the learned MTBF. The emergency-save plan (preemption.py) and the adaptive interval read it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from safepoint.dist import Comm
from safepoint.errors import CheckpointError, Preempted
from safepoint.policy.rules import AdaptiveInterval, AdaptiveSeconds, learned_mtbf
from safepoint.store.manifest import Manifest
from safepoint.store.posix_layout import CheckpointStore, Layout
from safepoint.store.records import CorruptRecordError, checked_float, list_field, parse_object
from safepoint.store.rootfs import RootDir

log = logging.getLogger("safepoint")
ATTEMPTS_NAME = ".attempts.json"
UPLOADS_NAME = ".uploads.json"
SAFETY_FACTOR = 1.25
"""An emergency save is expected to take this times the slowest of the recent saves."""
RECENT_SAVES = 3
_KEEP_UPLOADS = 10
# Both history files are read as regular files only (never through a symlink, never a FIFO that would
# hang the manager's start) and at most this big: a planted /dev/zero-sized file is not read.
_MAX_HISTORY_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class TierEstimate:
    """A storage tier an emergency save writes (fastest first) and its expected duration (None: unknown).

    ``basis`` says where the estimate comes from, for the log ("1.25x the slowest of the last 3 saves")."""

    name: str
    expected_s: float | None
    basis: str = ""


def _recent_manifests(layout: CheckpointStore, n: int) -> list[Manifest]:
    out: list[Manifest] = []
    try:
        steps = layout.committed_steps()
    except (OSError, CheckpointError):
        return out
    for step in reversed(steps):
        if len(out) == n:
            break
        with contextlib.suppress(OSError, CheckpointError):
            out.append(layout.read_manifest(step))
    return out


def _timings(m: Manifest) -> dict[str, float]:
    raw = m.extra.get("timings")
    if not isinstance(raw, dict):
        return {}
    return {k: float(v) for k, v in raw.items() if _number(v) and v >= 0}  # 10**400 overflows isfinite


def save_seconds(m: Manifest) -> float | None:
    """How long a recorded save took from capture to commit: (capture or stage) + write."""
    t = _timings(m)
    if "write_s" not in t:
        return None
    return t.get("capture_s", 0.0) + t.get("stage_s", 0.0) + t["write_s"]


def blocking_seconds(m: Manifest) -> float | None:
    """How long a recorded save blocked training: the staging copy (async) or the whole save (sync)."""
    t = _timings(m)
    if "stage_s" in t:
        return t["stage_s"]
    return save_seconds(m)


def expected_save_seconds(layout: CheckpointStore) -> float | None:
    """A synchronous save's expected duration: SAFETY_FACTOR x the slowest of the recent saves.

    From the manifests' recorded timings, so the history survives restarts. The slowest, not the mean:
    disk throughput swings several-fold between runs, and a save that overruns the grace is torn by SIGKILL.
    """
    durations = [d for m in _recent_manifests(layout, RECENT_SAVES) if (d := save_seconds(m)) is not None]
    return SAFETY_FACTOR * max(durations) if durations else None


def save_estimate(name: str, layout: CheckpointStore) -> TierEstimate:
    """The tier saves commit to, estimated from its manifests (either layout: only the protocol is read)."""
    return TierEstimate(
        name,
        expected_save_seconds(layout),
        f"{SAFETY_FACTOR:g}x the slowest of the last {RECENT_SAVES} saves",
    )


def write_json_atomically(fs: RootDir, name: str, data: object) -> None:
    """Temporary file, fsync, rename, fsync of the directory: a crash leaves the old file or the new one.
    All through the guarded walk (store/rootfs.py): a symlink planted at the name is replaced, never written
    through. Advisory files only: a failure is logged, never raised (they must not fail training)."""
    tmp = f"{name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        fs.write(tmp, json.dumps(data, indent=1).encode())
        fs.move(tmp, name)
        fs.fsync_dir()
    except OSError as e:
        with contextlib.suppress(OSError):
            fs.remove(tmp)
        log.warning("safepoint: cannot record the run history in %s: %s", fs.full(name), e)


class UploadHistory:
    """How long recent uploads to the durable tier took: ``LOCAL_ROOT/.uploads.json`` (tiering).

    The upload is not in the manifest (the manifest is committed locally before it starts), so its
    durations are kept here, written by rank 0 after each durable commit, so a restarted job plans its
    emergency save with its predecessor's measurements. Advisory: unreadable means no history."""

    def __init__(self, local_root: Path) -> None:
        self.fs, self.path = RootDir(local_root), local_root / UPLOADS_NAME
        self.seconds: list[float] = []
        try:
            raw = list_field(
                parse_object(self.fs.read(UPLOADS_NAME, _MAX_HISTORY_BYTES), str(self.path)),
                "uploads",
                str(self.path),
            )
            what = str(self.path)
            self.seconds = [
                checked_float(u.get("seconds") if isinstance(u, dict) else u, "seconds", what, lo=0, hi=1e9)
                for u in raw
            ]
        except FileNotFoundError:
            pass
        except (OSError, CorruptRecordError) as e:
            log.warning("safepoint: ignoring unreadable %s (%s)", self.path, e)

    def record(self, seconds: float, *, persist: bool) -> None:
        self.seconds = [*self.seconds, seconds][-_KEEP_UPLOADS:]
        if persist:
            write_json_atomically(
                self.fs, UPLOADS_NAME, {"version": 1, "uploads": [{"seconds": s} for s in self.seconds]}
            )

    def expected(self) -> float | None:
        """One upload's expected duration: SAFETY_FACTOR x the slowest of the recent ones (as for saves)."""
        recent = self.seconds[-RECENT_SAVES:]
        return SAFETY_FACTOR * max(recent) if recent else None

    def estimate(self, ahead: int) -> TierEstimate:
        """The durable tier's estimate: one upload, times the ``ahead`` uploads it would queue behind
        (uploads go in commit order, so the emergency one waits for those)."""
        one = self.expected()
        basis = f"{SAFETY_FACTOR:g}x the slowest of the last {RECENT_SAVES} uploads"
        if ahead:
            basis += f", behind {ahead} upload(s) in flight or queued"
        return TierEstimate("durable", None if one is None else one * (ahead + 1), basis)


def recorded_blocking_cost(layout: CheckpointStore) -> list[float]:
    """Blocking times of the newest checkpoints, oldest first: C for the adaptive interval after a restart."""
    costs = [c for m in _recent_manifests(layout, RECENT_SAVES) if (c := blocking_seconds(m)) is not None]
    return costs[::-1]


# ---- the run's attempts (for a learned MTBF) ------------------------------------------------------------

# How an attempt ended. Only the outcomes that lose work since the last checkpoint count as failures for
# the MTBF: a preemption whose emergency save committed loses nothing.
RUNNING, CLOSED, PREEMPTED, PREEMPTED_UNSAVED, FAILED, INTERRUPTED = (
    "running",
    "closed",
    "preempted",
    "preempted-unsaved",
    "failed",
    "interrupted",
)
FAILURES = frozenset({FAILED, PREEMPTED_UNSAVED})
MAX_ATTEMPTS = 200


@dataclasses.dataclass(frozen=True, slots=True)
class RunStats:
    """What the history says so far: running time of the ended attempts and how many of them failed."""

    observed_s: float
    failures: int
    attempts: int
    started: float  # wall time this attempt started


def summarize(attempts: Sequence[dict[str, Any]], started: float) -> RunStats:
    observed = 0.0
    failures = 0
    for a in attempts:
        if a.get("outcome") == RUNNING:
            continue  # the current attempt: its time is added live
        observed += max(0.0, float(a.get("end") or a["start"]) - float(a["start"]))
        failures += a.get("outcome") in FAILURES
    return RunStats(observed, failures, len(attempts), started)


class RunHistory:
    """``ROOT/.attempts.json``: one record per manager start (host, pid, start, end, outcome).

    Written by rank 0 only, atomically (temporary file, fsync, rename, fsync of ROOT). An attempt still
    marked ``running`` when the next one starts died without closing (SIGKILL, OOM, node loss): a failure.
    Its end is taken as the newest checkpoint it committed (its last sign of life; the time since then was
    lost anyway). The file is advisory: if it is unreadable the history starts over, with a warning.
    """

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.path = layout.root / ATTEMPTS_NAME
        self.attempts: list[dict[str, Any]] = []
        self.current: dict[str, Any] | None = None
        self.stats: RunStats | None = None  # what begin() found

    def _load(self) -> list[dict[str, Any]]:
        try:
            attempts = list_field(
                parse_object(self.layout.fs.read(ATTEMPTS_NAME, _MAX_HISTORY_BYTES), str(self.path)),
                "attempts",
                str(self.path),
            )
            if not isinstance(attempts, list) or not all(_well_formed(a) for a in attempts):
                raise ValueError("malformed attempts list")
            return attempts
        except FileNotFoundError:
            return []
        except (OSError, ValueError, CorruptRecordError) as e:
            log.warning(
                "safepoint: ignoring unreadable %s (%s); the restart history starts over", self.path, e
            )
            return []

    def _last_sign_of_life(self, start: float, until: float) -> float:
        try:
            steps = self.layout.committed_steps()
        except (OSError, CheckpointError):
            return start
        for step in reversed(steps):
            with contextlib.suppress(OSError, CheckpointError):
                t = self.layout.read_manifest(step).time
                if t < start:
                    break
                if t <= until:
                    return t
        return start

    def _write(self) -> None:
        write_json_atomically(self.layout.fs, ATTEMPTS_NAME, {"version": 1, "attempts": self.attempts})

    def begin(self) -> RunStats:
        """Rank 0: close out earlier attempts, record this one, return the stats."""
        now = time.time()
        attempts = self._load()
        for i, a in enumerate(attempts):
            if a.get("outcome") == RUNNING:
                until = float(attempts[i + 1]["start"]) if i + 1 < len(attempts) else now
                a["outcome"] = FAILED
                a["end"] = self._last_sign_of_life(float(a["start"]), until)
                a["inferred"] = True
        self.current = {
            "start": now,
            "end": None,
            "outcome": RUNNING,
            "host": os.uname().nodename,
            "pid": os.getpid(),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        }
        self.attempts = [*attempts, self.current][-MAX_ATTEMPTS:]
        self.stats = summarize(self.attempts, now)
        self._write()
        return self.stats

    def end(self, outcome: str) -> None:
        """Rank 0: record how this attempt ended (once)."""
        if self.current is None or self.current["outcome"] != RUNNING:
            return
        self.current["outcome"] = outcome
        self.current["end"] = time.time()
        self._write()


def outcome_of(exc: BaseException | None) -> str:
    """How an attempt that leaves the manager's ``with`` block ended, from the exception (if any)."""
    if exc is None:
        return CLOSED
    if isinstance(exc, Preempted):
        return PREEMPTED if exc.saved_step is not None else PREEMPTED_UNSAVED
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED
    return FAILED


def adaptive_policy(
    config: AdaptiveInterval,
    mtbf_seconds: float | None,
    layout: Layout,
    comm: Comm,
    costs: Callable[[], list[float]],
    runs: RunHistory | None,
) -> AdaptiveSeconds:
    """The ``save_every_seconds="auto"`` policy for a manager.

    C: the blocking times ``costs()`` returns, after those recorded in the newest manifests (so a restarted
    job starts from the cost its predecessor measured). M: ``mtbf_seconds``, or learned from ROOT's
    attempts file (``runs``: rank 0 of the root's owner read and wrote it at the start; the counts are
    broadcast, one collective at start-up; a manager that does not own the root learns from nothing).
    """
    recorded = recorded_blocking_cost(layout)
    mtbf: Callable[[], tuple[float, str]]
    if mtbf_seconds is not None:
        given = float(mtbf_seconds)
        mtbf = lambda: (given, "given")  # noqa: E731
    else:
        stats = comm.broadcast(runs.stats if runs is not None else None)
        learned = stats if stats is not None else RunStats(0.0, 0, 0, time.time())

        def mtbf() -> tuple[float, str]:
            observed = learned.observed_s + max(0.0, time.time() - learned.started)
            m = learned_mtbf(observed, learned.failures, config.prior_mtbf_s)
            return m, (
                f"learned: {learned.failures} failure(s) in {observed:.0f}s over {learned.attempts} "
                f"attempt(s), prior {config.prior_mtbf_s:.0f}s"
            )

    return AdaptiveSeconds(config, lambda: [*recorded, *costs()], mtbf)


def _number(x: Any) -> bool:
    # A float, or an int a float can hold: math.isfinite(10**400) raises OverflowError, and the
    # summaries do float arithmetic with it anyway.
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    return math.isfinite(x) if isinstance(x, float) else abs(x) < 2**53


def _well_formed(a: Any) -> bool:
    """An attempt record as summarize() and the inference of a killed run read it: a finite start, an end
    that is absent or a finite number, an outcome that is absent or a string. The file is advice: one bad
    record means the history starts over, never that the manager fails to start."""
    return (
        isinstance(a, dict)
        and _number(a.get("start"))
        and (a.get("end") is None or _number(a.get("end")))
        and (a.get("outcome") is None or isinstance(a.get("outcome"), str))
    )
