"""events: one typed event for each thing a checkpoint goes through, for the user's callbacks and loggers.

``CheckpointManager(on_event=...)`` takes a callable (or a list of them) that receives a
:class:`CheckpointEvent` for each save phase, restore, fallback, deletion, preemption notice and
emergency save. The standard ``logging`` module gets the same event as a record of the logger
``safepoint.events`` with its fields in ``extra`` (``record.event_type``, ``record.step``, ...), so a JSON
log formatter or a log shipper needs no callback. Ready sinks: :class:`JsonlSink` (a file path),
:class:`TensorBoardSink` (scalars) and :func:`when_committed` (the hook the framework integrations use to log
an artifact only once its checkpoint is committed).

Which thread calls a callback: the one where the event happened. The training thread for ``save_begin``,
``save`` (the call returned to the loop), the synchronous phases, ``restore*``, ``preemption`` and
``emergency_save``; with ``async_save`` the writer thread (``safepoint-save-N``) for ``save_written``,
``save_committed`` and ``save_failed``; rank 0's deleter thread for ``save_deleted``; the uploader thread
for ``save_durable`` on the durable tier. One lock serialises the calls, so a callback never runs twice at
once and sees events in the order they happened; it must be quick and must not call the manager (a callback
on the writer thread that waited for the save in flight would wait for itself). A callback that raises is
logged (with its traceback, once per callback) and skipped: it never fails a save or a restore.

Events are emitted on every rank that sees them (``event.rank``): log on ``rank == 0`` to log once a job.
Field names follow Orbax's checkpoint logs where they mean the same (``step``, ``event_type``,
``checkpointer_blocking_duration_secs``, ``checkpoint_manager_blocking_duration_secs``,
``wait_for_prev_duration_secs``, ``get_old_steps_duration_secs``; ``event_type`` "save" and "restore" are the
entries ``ml-goodput-measurement`` reads), so its checkpoint badput can be computed from these records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

log = logging.getLogger("safepoint.events")

# ---- event types (``CheckpointEvent.event_type``) ------------------------------------------------------
SAVE_BEGIN = "save_begin"
"""A save started (the training thread entered save/maybe_save's save)."""
SAVE = "save"
"""The save call returned to the training loop: staged (async) or committed (sync). Orbax's "save" entry:
``checkpointer_blocking_duration_secs`` is what the loop lost to it."""
SAVE_WRITTEN = "save_written"
"""Every file of this rank is written (DCP's write returned); the commit follows."""
SAVE_COMMITTED = "save_committed"
"""The checkpoint is committed (manifest written, renamed into place) on the tier that saves commit to."""
SAVE_DURABLE = "save_durable"
"""The checkpoint is durable on ``tier``: "root" (no tiering: the commit is fsynced), "durable" (uploaded)."""
SAVE_DELETED = "save_deleted"
"""Retention (or local pruning with tiering) deleted ``step`` from ``tier``."""
SAVE_FAILED = "save_failed"
"""A save failed; ``reason`` says why. Nothing of it was committed."""
RESTORE_BEGIN = "restore_begin"
RESTORE_FALLBACK = "restore_fallback"
"""A checkpoint (``step``) could not be used (``reason``): an older one is tried next."""
RESTORE = "restore"
"""A restore ended: ``step`` loaded (0: nothing to load), ``duration_secs`` it took."""
PREEMPTION = "preemption"
"""Every rank agreed on a preemption notice at ``step``; ``reason`` names this rank's notice,
``duration_secs`` is the time since it came (None: the notice came to another rank)."""
EMERGENCY_SAVE = "emergency_save"
"""What the preemption did: ``step`` saved (None: nothing saved, ``reason`` says why)."""
EVENT_TYPES = (
    SAVE_BEGIN, SAVE, SAVE_WRITTEN, SAVE_COMMITTED, SAVE_DURABLE, SAVE_DELETED, SAVE_FAILED,
    RESTORE_BEGIN, RESTORE_FALLBACK, RESTORE, PREEMPTION, EMERGENCY_SAVE,
)  # fmt: skip
_WARNINGS = frozenset({SAVE_FAILED, RESTORE_FALLBACK, PREEMPTION, EMERGENCY_SAVE})
_LEVELS = {**dict.fromkeys(_WARNINGS, logging.WARNING), SAVE_FAILED: logging.ERROR}  # the rest: INFO


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointEvent:
    """One thing that happened to a checkpoint. Fields that do not apply to an ``event_type`` are None."""

    event_type: str
    """One of ``EVENT_TYPES`` (``safepoint.events.SAVE_COMMITTED``, ...)."""
    step: int | None
    """The training step of the checkpoint concerned (None: none, e.g. a restore that found nothing)."""
    rank: int = 0
    """The rank that emitted it (events come from every rank that sees them)."""
    wall_time: float = 0.0
    """When it happened (``time.time()``)."""
    is_async: bool | None = None
    """Save events: whether the save was asynchronous (``async_save``)."""
    emergency: bool = False
    """Save events: the emergency save of a preemption."""
    tier: str | None = None
    """Where: "root" (no tiering), "local" or "durable" (tiering)."""
    directory: str | None = None
    """The checkpoint's path or URL, once it is committed (Orbax's ``directory``)."""
    bytes_written: int | None = None
    """Bytes written (this rank's for ``save_written``; the checkpoint's for committed/durable)."""
    bytes_skipped: int | None = None
    """Bytes not written again because an older checkpoint already held them (0 for a full save)."""
    duration_secs: float | None = None
    """How long this phase took (written: the write; committed: write + commit; durable: the upload;
    restore: the whole restore; deleted: the delete)."""
    throughput_bytes_per_sec: float | None = None
    """``bytes_written / duration_secs`` where both are known."""
    checkpointer_blocking_duration_secs: float | None = None
    """``save``: seconds the training loop was blocked by the save itself (capture + stage for async, the
    whole save for sync), not counting ``wait_for_prev_duration_secs``."""
    checkpoint_manager_blocking_duration_secs: float | None = None
    """``save``: seconds the save call blocked in all (waiting for the previous save included)."""
    checkpoint_manager_blocking_start_time: float | None = None
    """``save``: wall time the save call started."""
    wait_for_prev_duration_secs: float | None = None
    """``save``: seconds waited for the previous async save to finish before this one could start."""
    get_old_steps_duration_secs: float | None = None
    """``save_deleted``: seconds the retention pass spent deciding what to delete."""
    lag_secs: float | None = None
    """``save_durable``: seconds from the local commit to durable (0 without tiering)."""
    reason: str | None = None
    """Failures, fallbacks, notices: why, in words."""

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set (None left out), JSON-ready; restore events also carry Orbax's names."""
        # The names taken once (dataclasses.fields builds its tuple at every call: six events per save).
        out = {k: v for k in _FIELD_NAMES if (v := getattr(self, k)) is not None}
        if self.event_type == RESTORE and self.duration_secs is not None:
            out["checkpoint_manager_duration_secs"] = self.duration_secs
        return out


EventSink = Callable[[CheckpointEvent], None]
_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(CheckpointEvent))


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, 6)


class Events:
    """A manager's event stream: builds each event, hands it to the logging record and every sink.

    Thread-safe (one re-entrant lock: sinks run one at a time, in emission order). A sink that raises is
    logged and skipped (the first failure of each sink with its traceback, later ones at debug level)."""

    def __init__(self, sinks: Iterable[EventSink] = ()) -> None:
        self.rank = 0  # set by the manager once its process group exists
        self._sinks = list(sinks)
        self._failed: set[int] = set()
        self._closed: set[int] = set()
        self._lock = threading.RLock()

    def subscribe(self, sink: EventSink) -> None:
        """Add a sink (an integration's logger hook, say) to a manager that exists already."""
        with self._lock:
            self._sinks.append(sink)

    def unsubscribe(self, sink: EventSink) -> None:
        """Remove a sink added by :meth:`subscribe` (when an integration's training ends); no-op if absent."""
        with self._lock:
            if sink in self._sinks:
                self._sinks.remove(sink)

    def emit(self, event_type: str, step: int | None, **fields: Any) -> CheckpointEvent | None:
        """Build the event and deliver it. Never raises (a broken sink or log handler is logged)."""
        if not self._listened(event_type):
            return None  # nobody listens: no event is built (this runs on the save path, ~6 per save)
        try:
            for key in ("duration_secs", "lag_secs", *_BLOCKING):
                if key in fields:
                    fields[key] = _finite(fields[key])
            nbytes, seconds = fields.get("bytes_written"), fields.get("duration_secs")
            if nbytes is not None and seconds and "throughput_bytes_per_sec" not in fields:
                fields["throughput_bytes_per_sec"] = round(nbytes / seconds, 1)
            event = CheckpointEvent(event_type, step, rank=self.rank, wall_time=time.time(), **fields)
        except (TypeError, ValueError, ZeroDivisionError) as e:  # a bug here must not fail the save
            log.warning("safepoint: could not build the %s event: %r", event_type, e)
            return None
        with self._lock:
            _log_record(event)
            for sink in self._sinks:
                try:
                    sink(event)
                except Exception as e:
                    first = id(sink) not in self._failed
                    self._failed.add(id(sink))
                    log.log(
                        logging.WARNING if first else logging.DEBUG,
                        "safepoint: event callback %r failed on %s (ignored; the save goes on): %r",
                        sink, event_type, e, exc_info=first,
                    )  # fmt: skip
        return event

    def _listened(self, event_type: str) -> bool:
        """Whether the log records it or a sink may read it (a sink's ``event_types``, if any, say which)."""
        wanted = (getattr(sink, "event_types", None) for sink in self._sinks)
        return log.isEnabledFor(_level(event_type)) or any(w is None or event_type in w for w in wanted)

    def close(self) -> None:
        """Close the sinks that have a ``close`` (files, writers); the manager's close() calls it."""
        with self._lock:
            for sink in self._sinks:
                closer = getattr(sink, "close", None)
                if callable(closer) and id(sink) not in self._closed:  # once (the manager may call it twice)
                    self._closed.add(id(sink))
                    try:
                        closer()
                    except Exception as e:
                        log.warning("safepoint: closing event sink %r failed: %r", sink, e)


_BLOCKING = (
    "checkpointer_blocking_duration_secs",
    "checkpoint_manager_blocking_duration_secs",
    "wait_for_prev_duration_secs",
    "get_old_steps_duration_secs",
)
NO_EVENTS = Events()
"""What a part that no manager wired emits to: the logging record only (and only if enabled)."""


def _level(event_type: str) -> int:
    return _LEVELS.get(event_type, logging.INFO)


def _log_record(event: CheckpointEvent) -> None:
    level = _level(event.event_type)
    if not log.isEnabledFor(level):
        return
    fields = event.to_dict()
    # LogRecord's own attribute names are refused in ``extra``: those fields are only in safepoint_event.
    extra = {k: v for k, v in fields.items() if k not in _RESERVED}
    extra["safepoint_event"] = fields
    log.log(
        level, "safepoint event %s step=%s rank=%d", event.event_type, event.step, event.rank, extra=extra
    )


_RESERVED = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


def subscribers(on_event: EventSink | Iterable[EventSink] | None) -> list[EventSink]:
    """``on_event=`` as a list of sinks (ValueError for anything that is not a callable or a list of them)."""
    if on_event is None:
        return []
    sinks = [on_event] if callable(on_event) else list(on_event)
    for sink in sinks:
        if not callable(sink):
            raise ValueError(
                f"on_event must be a callable taking a safepoint.CheckpointEvent, or a list of them; "
                f"got {type(sink).__name__}"
            )
    return sinks


# ---- ready sinks ---------------------------------------------------------------------------------------


class JsonlSink:
    """Appends each event as one JSON line to ``path`` (a file of the user's, outside the checkpoint root).

    ``ranks``: which ranks write (default rank 0 only; None: every rank, then give each its own path)."""

    def __init__(self, path: str | os.PathLike[str], *, ranks: Iterable[int] | None = (0,)) -> None:
        self.path = os.fspath(path)
        self.ranks = None if ranks is None else frozenset(ranks)
        self._file: Any = None

    def __call__(self, event: CheckpointEvent) -> None:
        if self.ranks is not None and event.rank not in self.ranks:
            return
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self._file.write(json.dumps(event.to_dict(), sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# The scalars a TensorBoard sink writes: event type -> the fields plotted (tag: safepoint/<event>/<field>).
TENSORBOARD_SCALARS = {
    SAVE: ("checkpointer_blocking_duration_secs", "wait_for_prev_duration_secs"),
    SAVE_COMMITTED: ("duration_secs", "bytes_written", "throughput_bytes_per_sec"),
    SAVE_DURABLE: ("duration_secs", "lag_secs"),
    RESTORE: ("duration_secs",),
}


class TensorBoardSink:
    """Writes the save/restore timings as TensorBoard scalars (rank 0 only), at the event's step.

    ``writer``: a log directory (a ``torch.utils.tensorboard.SummaryWriter`` is created there on the first
    event; it needs the ``tensorboard`` package: ``pip install safepoint[tensorboard]``) or any object with
    ``add_scalar(tag, value, global_step)`` (the SummaryWriter a training script already has)."""

    def __init__(self, writer: Any, *, prefix: str = "safepoint") -> None:
        self._writer = writer
        self._owned = isinstance(writer, (str, os.PathLike))
        self.prefix = prefix

    def __call__(self, event: CheckpointEvent) -> None:
        fields = TENSORBOARD_SCALARS.get(event.event_type)
        if event.rank != 0 or fields is None or event.step is None:
            return
        if isinstance(self._writer, (str, os.PathLike)):
            from torch.utils.tensorboard import SummaryWriter  # imported here: tensorboard is optional

            self._writer = SummaryWriter(os.fspath(self._writer))
        for name in fields:
            value = getattr(event, name)
            if value is not None:
                tag = f"{self.prefix}/{event.event_type}/{name}"
                self._writer.add_scalar(tag, float(value), global_step=event.step)

    def close(self) -> None:
        if self._owned and not isinstance(self._writer, (str, os.PathLike)):
            self._writer.close()


def when_committed(
    callback: Callable[[int, str], None], *, durable: bool = False, ranks: Iterable[int] = (0,)
) -> EventSink:
    """The hook for framework loggers (W&B, MLflow artifacts): ``callback(step, directory)`` once the
    checkpoint of ``step`` is committed, never earlier (not when an async save was merely staged, the
    mistake of Lightning's ``after_save_checkpoint``, Lightning #17915). ``durable=True``: once it is durable
    instead (with tiering, uploaded to the durable root). Called on rank 0 only by default, on the thread
    that committed it (the writer thread for an async save)."""
    wanted, only = (SAVE_DURABLE if durable else SAVE_COMMITTED), frozenset(ranks)

    def sink(event: CheckpointEvent) -> None:
        if event.event_type == wanted and event.rank in only and event.step is not None and event.directory:
            if durable and event.tier not in ("root", "durable"):
                return
            callback(event.step, event.directory)

    return sink


class SaveCall:
    """One save call as the training loop sees it: ``save_begin`` once the previous save is out of the way
    (:meth:`begin`), ``save_failed`` for an exception out of :meth:`failing`, and ``save`` when the call
    returns to the loop (:meth:`returned`, with the blocking times Orbax logs)."""

    def __init__(self, events: Events, step: int, **flags: Any) -> None:
        self.events, self.step, self.flags = events, step, flags
        self.started, self.t_call = time.time(), time.perf_counter()
        self.t0 = self.t_call

    def begin(self) -> float:
        """The save proper starts (waiting for the previous one is over); returns ``perf_counter()``."""
        self.t0 = time.perf_counter()
        self.events.emit(SAVE_BEGIN, self.step, **self.flags)
        return self.t0

    @contextlib.contextmanager
    def failing(self, reported: type[BaseException]) -> Iterator[None]:
        """``save_failed`` for an exception out of the block, unless it is a ``reported`` one (the saver
        emits its own failures, with the reason it gave every rank); the exception goes on."""
        try:
            yield
        except BaseException as e:
            if not isinstance(e, reported):
                self.events.emit(SAVE_FAILED, self.step, reason=f"{type(e).__name__}: {e}", **self.flags)
            raise

    def returned(self, **fields: Any) -> float:
        """The call returns to the loop: the ``save`` event; returns the seconds the save itself blocked."""
        now = time.perf_counter()
        blocking = now - self.t0
        self.events.emit(
            SAVE,
            self.step,
            **self.flags,
            checkpointer_blocking_duration_secs=blocking,
            checkpoint_manager_blocking_duration_secs=now - self.t_call,
            wait_for_prev_duration_secs=self.t0 - self.t_call,
            checkpoint_manager_blocking_start_time=self.started,
            **fields,
        )
        return blocking


def durable(info: Any, t0: float, committed_at: float) -> dict[str, Any]:
    """A ``save_durable`` event's fields: ``info`` (a CheckpointInfo) became durable; the copy started at
    ``t0`` (``perf_counter``), the checkpoint was committed at ``committed_at`` (wall time)."""
    took, lag = time.perf_counter() - t0, time.time() - committed_at
    return {"directory": str(info.path), "bytes_written": info.bytes, "duration_secs": took, "lag_secs": lag}


def wire(events: Events, *parts: Any, rank: int | None = None) -> None:
    """Give each part (saver, restorer, retainer, tiers, ...; None skipped) the manager's stream."""
    if rank is not None:
        events.rank = rank
    for part in parts:
        if part is not None:
            part.events = events
