"""The manager's option objects, and the checks of its arguments that no part it builds makes.

``CheckpointManager`` keeps the common knobs flat (when to save, async, tiers, resume); the rest are grouped
one small frozen dataclass per concern (``keep=`` in policy/keep.py, the others here), each field
documented and validated in ``__post_init__``. Every argument is validated before the first process group
exists (dist.new_group): a bad one must not leak a gloo group (and its threads) per attempt.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from safepoint.store.heartbeat import MIN_STALE_AFTER_S, check_lease_timing, heartbeat_for
from safepoint.store.job import check_job_id

ASYNC_WRITERS = ("auto", "thread", "process")
DEFAULT_EXIT_CODE = 143
"""128 + SIGTERM: what a process killed by the notice's SIGTERM reports, so an orchestrator (Kubernetes
``podFailurePolicy``, systemd ``SuccessExitStatus``, torchrun, Slurm) treats a saved-and-exited job the
same as one that was terminated by the signal; non-zero, so torchrun restarts the workers."""


def _positive_number(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WriterOptions:
    """How saves are written: ``CheckpointManager(writer=safepoint.WriterOptions(...))``."""

    async_writer: str = "auto"
    """With ``async_save``: "process" (a writer process per rank reading the staging buffers in shared
    memory; Linux, local roots and local_root; started with the manager), "thread" (a background thread of
    this process), or "auto" (the thread while the state is small; where the process can run, it starts at
    the first async save of a state of at least ``save.writer_choice.AUTO_PROCESS_MIN_ITEMS`` tensors, and
    stays). See docs/async.md."""
    if_busy: str = "wait"
    """With ``async_save``, what a save does while the previous one is still writing: "wait" (waits for the
    write, logging how long, then stages), "auto" (written synchronously at once, beside the write in
    flight, which waits meanwhile: it blocks as long as a sync save and no save is lost, but the newer step
    may commit first) or
    "skip" (warns, saves nothing). Never two staged copies. See docs/async.md."""
    threads: int = 1
    """DCP writer threads per rank."""
    incremental: bool = True
    """Write only what changed: a tensor whose bytes equal the previous committed save's (proven by a
    fingerprint of its bytes) is not written again; its file is hard-linked from the previous step (on an
    object store: copied server-side), so every step stays a complete DCP checkpoint. See
    docs/incremental.md."""
    full_every: int = 10
    """With ``incremental``: every ``full_every``-th save links nothing (a physical full copy), and retention
    keeps the newest step sharing no file with the newest one, so a damaged shared file always leaves an
    intact older step (docs/reliability.md). 0: never a full copy after a process's first save (least
    space; one damaged shared file can damage every retained step)."""

    def __post_init__(self) -> None:
        if not isinstance(self.incremental, bool):
            raise ValueError(f"WriterOptions.incremental must be a bool, got {self.incremental!r}")
        full = self.full_every
        if isinstance(full, bool) or not isinstance(full, int) or full < 0:
            raise ValueError(f"WriterOptions.full_every must be a non-negative int, got {full!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"WriterOptions.threads must be a positive int, got {self.threads!r}")
        if self.if_busy not in ("auto", "wait", "skip"):
            raise ValueError(f"WriterOptions.if_busy must be 'auto', 'wait' or 'skip', got {self.if_busy!r}")
        if self.async_writer not in ASYNC_WRITERS:
            raise ValueError(
                f"WriterOptions.async_writer must be 'auto', 'thread' or 'process', got {self.async_writer!r}"
            )
        if self.async_writer == "process" and not hasattr(os, "memfd_create"):
            raise ValueError("async_writer='process' needs Linux (memfd_create); use async_writer='thread'")


def _notice_signals(signals: object) -> tuple[signal.Signals, ...]:
    if isinstance(signals, (int, str)) or not isinstance(signals, Iterable):
        raise ValueError(f"PreemptionOptions.signals must be a list of signals, got {signals!r}")
    found: list[signal.Signals] = []
    for s in signals:
        try:
            if isinstance(s, bool) or not isinstance(s, int):
                raise ValueError
            found.append(signal.Signals(s))
        except ValueError:
            raise ValueError(f"PreemptionOptions.signals: {s!r} is not a signal") from None
    if signal.SIGKILL in found or signal.SIGSTOP in found:
        raise ValueError(
            "PreemptionOptions.signals: SIGKILL and SIGSTOP cannot be caught, so cannot be notices"
        )
    return tuple(dict.fromkeys(found))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PreemptionOptions:
    """Preemption: where notices come from, the grace they give, and the exit after the emergency save:
    ``CheckpointManager(preemption=safepoint.PreemptionOptions(signals=[signal.SIGTERM], grace_seconds=30))``.
    On a notice, the next ``maybe_save`` saves the current step and raises ``safepoint.Preempted``. No
    source configured (the default): no handlers, no thread. See docs/preemption.md."""

    signals: Iterable[int | signal.Signals] = ()
    """Notice signals (e.g. ``[signal.SIGTERM]``, Slurm's ``--signal=B:USR1@90``); handlers are installed
    from the main thread only, and the previous handler is still called."""
    grace_seconds: float | None = None
    """Time from a notice to SIGKILL: an emergency save expected not to fit is skipped and logged (with
    tiering, one whose upload alone does not fit is committed locally only). None: no deadline."""
    file: str | os.PathLike[str] | None = None
    """A sentinel file: its appearance is a notice (checked by a background thread)."""
    poll: Callable[[], object] | None = None
    """A callable polled in the background (e.g. a cloud metadata endpoint); a truthy result is a notice."""
    poll_interval_s: float = 5.0
    """How often ``file`` and ``poll`` are checked."""
    exit_code: int = DEFAULT_EXIT_CODE
    """The exit status ``safepoint.Preempted`` carries after the emergency save (default 143)."""
    shield_workers: bool = True
    """DataLoader worker processes forked while the manager is open survive the notice ``signals`` sent to
    the whole process group (torchrun's agent, Slurm) so the emergency save can run; they still exit when
    the rank shuts the loader down or dies. False: workers die of the signal as PyTorch makes them."""

    def __post_init__(self) -> None:
        # A tuple of signal.Signals whatever was given (a list, ints): the object stays frozen and hashable.
        object.__setattr__(self, "signals", _notice_signals(self.signals))
        if self.grace_seconds is not None:
            _positive_number("PreemptionOptions.grace_seconds", self.grace_seconds)
        _positive_number("PreemptionOptions.poll_interval_s", self.poll_interval_s)
        if not isinstance(self.shield_workers, bool):
            raise ValueError(f"PreemptionOptions.shield_workers must be a bool, got {self.shield_workers!r}")
        if self.poll is not None and not callable(self.poll):
            raise ValueError(f"PreemptionOptions.poll must be callable, got {self.poll!r}")
        # 0 would tell torchrun and the scheduler that the job finished: it would never be restarted.
        code = self.exit_code
        if isinstance(code, bool) or not isinstance(code, int) or not 1 <= code <= 255:
            raise ValueError(f"PreemptionOptions.exit_code must be an int in 1..255 (non-zero), got {code!r}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WarmStart:
    """``CheckpointManager(init_from=...)``: where a fresh run starts from when its own root holds no
    checkpoint (a plain path or URL means ``WarmStart(path=...)``). Read only: nothing is written there."""

    path: str | os.PathLike[str]
    """Another run's root (its newest intact checkpoint) or one step's directory (``runs/a/step-1000``)."""
    step: int | None = None
    """With a root: load exactly this step instead of the newest."""
    strict: bool = True
    """As ``restore(strict=...)``: False loads what matches and reports the rest."""
    ignore: tuple[str, ...] = ()
    """As ``restore(ignore=...)``: key patterns never loaded (``("optimizer", "scheduler")`` for weights
    only)."""
    remap: Callable[[str], str | None] | None = None
    """As ``restore(remap=...)``: saved key -> state key (None drops it)."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            raise ValueError(f"WarmStart.path must be a non-empty path or URL, got {self.path!r}")
        step = self.step
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"WarmStart.step must be a non-negative int or None, got {step!r}")
        if not isinstance(self.strict, bool):
            raise ValueError(f"WarmStart.strict must be a bool, got {self.strict!r}")
        if isinstance(self.ignore, str) or not all(isinstance(p, str) and p for p in self.ignore):
            raise ValueError(f"WarmStart.ignore must be a tuple of key patterns, got {self.ignore!r}")
        if self.remap is not None and not callable(self.remap):
            raise ValueError(f"WarmStart.remap must be callable, got {self.remap!r}")

    @classmethod
    def of(cls, spec: WarmStart | str | os.PathLike[str] | None) -> WarmStart | None:
        if spec is None or isinstance(spec, WarmStart):
            return spec
        if not isinstance(spec, (str, os.PathLike)):
            raise ValueError(f"init_from must be a path, a URL or a safepoint.WarmStart, got {spec!r}")
        return cls(path=spec)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ClusterOptions:
    """How the ranks of a job coordinate and own the root: ``CheckpointManager(cluster=...)``."""

    collective_timeout_s: float = 600.0
    """Bound on every collective safepoint runs among ranks: a dead peer is an error, not a hang."""
    lease_stale_after_s: float = 120.0
    """A lease whose heartbeat is older than this (another host) is taken over."""
    job_id: str | None = None
    """Names this job in the root's lease: a restart of the same job takes the lease over at once, on any
    host, instead of waiting ``lease_stale_after_s`` for the dead holder's heartbeat to age (the old holder
    is fenced out). None: ``SAFEPOINT_JOB_ID``, else Slurm's job id, else torchrun's ``--rdzv-id`` (see
    docs/elastic.md). It must name one job only: ids many jobs share ("none", "default") are refused."""
    background_deletes: bool = True
    """Run retention's deletes on rank 0's deleter thread, off the save's path (the default): a save
    returns once committed and the next one never waits on deletes; ``wait``/``restore``/``close`` drain
    them (so ``list()`` right after ``save()`` may still show a checkpoint being deleted; after ``wait()``
    it does not). A preemption notice or a lost lease stops them; what is left is deleted by the next
    owner's first save. False: rank 0 deletes inside ``save()``, after the save's verdict, as the other
    ranks go on (rank 0 is late for the next collective by that long). Both are crash-safe and covered
    by the crash and fault campaigns operation by operation."""

    def __post_init__(self) -> None:
        _positive_number("ClusterOptions.collective_timeout_s", self.collective_timeout_s)
        check_lease_stale_after(self.lease_stale_after_s)
        if self.job_id is not None:
            check_job_id(self.job_id)
        if not isinstance(self.background_deletes, bool):
            got = self.background_deletes
            raise ValueError(f"ClusterOptions.background_deletes must be a bool, got {got!r}")


MOVED_KEYWORDS: Mapping[str, str] = {
    "keep_last": "keep=safepoint.Keep(last=...)",
    "keep_every_steps": "keep=safepoint.Keep(every_steps=...)",
    "keep_best": "keep=safepoint.Keep(best=safepoint.KeepBest(n, metric=..., mode=...))",
    "best_metric": "keep=safepoint.Keep(best=safepoint.KeepBest(n, metric=..., mode=...))",
    "best_mode": "keep=safepoint.Keep(best=safepoint.KeepBest(n, metric=..., mode=...))",
    "keep_local_last": "keep=safepoint.Keep(local_last=...)",
    "preemption_signals": "preemption=safepoint.PreemptionOptions(signals=[...])",
    "grace_seconds": "preemption=safepoint.PreemptionOptions(grace_seconds=...)",
    "async_writer": "writer=safepoint.WriterOptions(async_writer=...)",
    "if_busy": "writer=safepoint.WriterOptions(if_busy=...)",
    "writer_threads": "writer=safepoint.WriterOptions(threads=...)",
    "preemption_file": "preemption=safepoint.PreemptionOptions(file=...)",
    "preemption_poll": "preemption=safepoint.PreemptionOptions(poll=...)",
    "preemption_poll_interval_s": "preemption=safepoint.PreemptionOptions(poll_interval_s=...)",
    "preempted_exit_code": "preemption=safepoint.PreemptionOptions(exit_code=...)",
    "collective_timeout_s": "cluster=safepoint.ClusterOptions(collective_timeout_s=...)",
    "lease_stale_after_s": "cluster=safepoint.ClusterOptions(lease_stale_after_s=...)",
    "mtbf_seconds": "save_every_seconds=safepoint.AdaptiveInterval(mtbf_s=...)",
    "upload_retries": "transfer=safepoint.TransferOptions(attempts=retries + 1)",
    "upload_concurrency": "transfer=safepoint.TransferOptions(concurrency=...)",
}
"""Keywords of CheckpointManager that moved into an option object, and their new home."""


def check_step(step: int | None, *, optional: bool = False) -> None:
    """A step is a non-negative int (the optimizer steps completed); ``optional``: None is accepted."""
    if optional and step is None:
        return
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")


def reject_moved(kwargs: Mapping[str, Any]) -> None:
    """A moved keyword fails with its new home named; any other unknown keyword as Python would."""
    for name in kwargs:
        if name in MOVED_KEYWORDS:
            raise TypeError(f"CheckpointManager: {name}= moved; pass {MOVED_KEYWORDS[name]}")
        raise TypeError(f"CheckpointManager() got an unexpected keyword argument {name!r}")


def check_option_types(**options: object) -> None:
    """Each option object is of its class (or None): a dict or a typo'd class fails here, by name."""
    kinds = {"writer": WriterOptions, "preemption": PreemptionOptions, "cluster": ClusterOptions}
    for name, value in options.items():
        if value is not None and not isinstance(value, kinds[name]):
            raise TypeError(f"{name}= takes a safepoint.{kinds[name].__name__}, got {type(value).__name__}")


RESUME_MODES = ("auto", "required", "never")
"""CheckpointManager(resume=...): see tiers/resume.py."""


def check_manager_arguments(writer: WriterOptions, async_save: bool, resume: object = "auto") -> None:
    if not isinstance(resume, str) or resume not in RESUME_MODES:
        raise ValueError(f"resume must be 'auto', 'required' or 'never', got {resume!r}")
    if writer.async_writer == "process" and not async_save:
        raise ValueError("async_writer='process' writes async saves: pass async_save=True as well")


def check_lease_stale_after(stale_after_s: float) -> None:
    """A finite number of seconds, at least MIN_STALE_AFTER_S; the heartbeat then beats at most every
    quarter of it (lease.heartbeat_for), so the limit always exceeds twice the heartbeat interval."""
    ok = isinstance(stale_after_s, (int, float)) and not isinstance(stale_after_s, bool)
    if not ok or not math.isfinite(stale_after_s) or stale_after_s < MIN_STALE_AFTER_S:
        raise ValueError(
            f"lease_stale_after_s must be a finite number of seconds >= {MIN_STALE_AFTER_S:g}, got "
            f"{stale_after_s!r}"
        )
    check_lease_timing(stale_after_s, heartbeat_for(stale_after_s))


def check_keep_local_last(keep_local_last: int) -> None:
    if isinstance(keep_local_last, bool) or not isinstance(keep_local_last, int) or keep_local_last < 1:
        raise ValueError(f"keep_local_last must be a positive int, got {keep_local_last!r}")


def writer_process_mode(async_save: bool, async_writer: str, local_files: bool) -> bool | None:
    """None: async saves (if any) need no writer process; else whether one that cannot start may be
    replaced by the writer thread ("auto") rather than fail the save ("process").

    "auto" may start the process wherever it can run, once a state is large enough for it to pay
    (save/writer_choice.py): it halves what a save costs a Python-bound loop over a many-tensor state and
    ties or loses elsewhere (docs/benchmarks.md).
    """
    if async_writer == "process" and not local_files:
        raise ValueError(
            "async_writer='process' writes local files: with a URL root, pass local_root= (saves commit "
            "there and upload in the background) or use async_writer='thread'"
        )
    if not async_save:
        return None
    if async_writer == "process":
        return False
    if async_writer == "auto" and local_files and hasattr(os, "memfd_create"):
        return True
    return None
