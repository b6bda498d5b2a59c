"""CheckpointManager: composes capture, write, commit, retain and restore. Holds no I/O details itself."""

from __future__ import annotations

import atexit
import logging
import os
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, cast

from safepoint import options as opts
from safepoint.dist import Comm
from safepoint.emergency import EmergencySave
from safepoint.errors import CheckpointError, Preempted, SaveError
from safepoint.events import Events, EventSink, SaveCall, subscribers, wire
from safepoint.options import ClusterOptions, PreemptionOptions, WarmStart, WriterOptions
from safepoint.policy.history import RunHistory, outcome_of
from safepoint.policy.keep import Keep
from safepoint.policy.retainer import Retainer
from safepoint.policy.rules import AdaptiveInterval, Retention, Verdicts
from safepoint.policy.schedule import SaveSchedule
from safepoint.preempt.preemption import Preemption
from safepoint.remote.upload import TransferOptions
from safepoint.restore.partial import RestoreReport, Selection
from safepoint.restore.restorer import Restorer
from safepoint.save.background import BackgroundWriter
from safepoint.save.saver import SyncSaver
from safepoint.save.writer_choice import WriterChoice
from safepoint.save.writer_process import WriterProcess
from safepoint.state import TrainState
from safepoint.store.gc_pause import gc_paused
from safepoint.store.incremental import History
from safepoint.store.job import job_identity
from safepoint.store.manifest import clean_metrics
from safepoint.store.posix_layout import CheckpointInfo, Layout
from safepoint.tiers.base import DurabilityLag, SingleTier, check_owner, plan_tiers, take_ownership
from safepoint.tiers.held import HeldRoots
from safepoint.tiers.journal_mirror import open_runs
from safepoint.tiers.node_tiers import build_tiers
from safepoint.tiers.resume import Resume

log = logging.getLogger("safepoint")
Saved = tuple[bool, CheckpointInfo | None]  # (a save started, not skipped; the committed one if sync)


class CheckpointManager:
    """Saves a TrainState atomically and verifiably; restores the newest intact checkpoint.

    Args:
        root: checkpoint directory (created if missing), or a URL (``s3://bucket/run``; any fsspec URL).
        save_every_steps: ``maybe_save`` saves when ``step`` is a multiple of this.
        save_every_seconds: ``maybe_save`` saves when this many seconds passed since the last save (ranks
            agree); ``"auto"`` or a ``safepoint.AdaptiveInterval``: Daly's interval from the measured save
            cost and the MTBF (docs/preemption.md).
        keep: ``safepoint.Keep(last=3, every_steps=1000, best=safepoint.KeepBest(2, metric="loss"))``:
            retention; the union of what each rule keeps survives, the newest always does. None: keep all.
        async_save: ``save``/``maybe_save`` block only while the state is copied into reused host buffers;
            writing, checksums, commit and retention run in the background (``writer=`` says where).
        local_root: with a URL ``root``: saves commit here first (fast local disk), and a background
            uploader makes each one durable at ``root`` (``Keep.local_last`` copies stay here).
        storage_options: passed to fsspec (endpoint, credentials). See docs/storage.md.
        preemption: ``safepoint.PreemptionOptions(signals=[signal.SIGTERM], grace_seconds=30)``: on a
            notice, the next ``maybe_save`` saves the current step and raises ``safepoint.Preempted``.
        writer: ``safepoint.WriterOptions``: async writer (process or thread), if busy, DCP writer threads.
        cluster: ``safepoint.ClusterOptions``: collective timeout, lease staleness, the job's identity.
        transfer: ``safepoint.TransferOptions``: retries, concurrency, part sizes of object-store transfers.
        resume: "auto" (the newest intact checkpoint, else step 0), "required" (CheckpointError naming the
            root and what it holds if there is none), "never" (step 0; checkpoints kept, not loaded).
        init_from: a warm start (root, step-N directory or ``safepoint.WarmStart``) when ``root`` has none.
        on_event: callable(s) given a ``safepoint.CheckpointEvent`` per save phase, restore, preemption.

    Keywords that moved into an option object fail with their new home named (``options.MOVED_KEYWORDS``).
    One process holds a root through one open manager: a second one on it raises ``LeaseError`` saying so.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        save_every_steps: int | None = None,
        save_every_seconds: float | str | AdaptiveInterval | None = None,
        keep: Keep | None = None,
        async_save: bool = False,
        local_root: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        preemption: PreemptionOptions | None = None,
        writer: WriterOptions | None = None,
        cluster: ClusterOptions | None = None,
        transfer: TransferOptions | None = None,
        resume: str = "auto",
        init_from: str | os.PathLike[str] | WarmStart | None = None,
        on_event: EventSink | Iterable[EventSink] | None = None,
        **moved: Any,
    ) -> None:
        opts.reject_moved(moved)
        self.events = Events(subscribers(on_event))  # events.py; ``events.subscribe`` adds a sink later
        opts.check_option_types(writer=writer, preemption=preemption, cluster=cluster)
        writer, cluster, keep = writer or WriterOptions(), cluster or ClusterOptions(), Keep.of(keep)
        notices = preemption or PreemptionOptions()
        self.root, self.layout, durable = plan_tiers(
            root, local_root, storage_options, transfer or TransferOptions()
        )
        # Every argument is validated before the first process group exists (see options.py).
        opts.check_manager_arguments(writer, async_save, resume)
        self._job = job_identity(cluster.job_id)  # SAFEPOINT_JOB_ID is checked here too
        warm = WarmStart.of(init_from)  # with tiering, the durable root says what a job has
        self._resume = Resume(resume, durable or self.layout, warm, storage_options)
        self.last_restore: RestoreReport | None = None  # what the last restore() loaded, and left
        local = isinstance(self.layout, Layout)
        process_fallback = opts.writer_process_mode(async_save, writer.async_writer, local)
        self._schedule = SaveSchedule(save_every_steps, save_every_seconds, local=local)
        self.saves = self._schedule.saves  # the same list: what the training loop's saves cost
        self._comms: list[Comm] = []  # every group this manager created, destroyed if __init__ fails
        self._lease: Any = None
        self._closed = False
        self._runs: RunHistory | None = None
        self._emergency: EmergencySave | None = None
        self._current: CheckpointInfo | None = None  # the committed checkpoint the state now is (sync)
        self._async = bool(async_save)
        self._held = HeldRoots(self.layout, durable)  # last check: nothing to give back if it refuses
        try:  # whatever fails (KeyboardInterrupt included), nothing started here outlives the constructor
            self._build(durable, keep, cluster, writer, process_fallback)
            self._preemption = Preemption.build(self.comm, notices)
            self._resume.before_create(self.comm)
            self._take_ownership(cluster.lease_stale_after_s)
            self._runs, self._journal = open_runs(
                self.layout, durable, self.comm, self._read_only, self.events
            )
            if isinstance(self.layout, Layout):  # "auto" was refused above for a URL root alone
                self._schedule.add_adaptive(self.layout, self.comm, self._runs)
            if self._at_exit:
                # A script that ends without close() must not kill the writer mid-file at interpreter
                # shutdown (torch's C++ writer aborts the process then): let the save in flight finish.
                atexit.register(self._finish_at_exit)
            if self._preemption is not None:
                parts = (self._schedule, self._tiers, self.layout, self._writer, self._retainer, self._runs)
                self._emergency = EmergencySave(self._preemption, *parts, self._save_sync)
                self._preemption.start()
        except BaseException:
            self._destroy_parts()
            raise

    @property
    def _process(self) -> WriterProcess | None:
        """The writer process of async saves, once one started (tests and benchmarks look at it)."""
        return self._writers.process if hasattr(self, "_writers") else None

    def _new_comm(self, timeout_s: float) -> Comm:
        self._comms.append(Comm(timeout_s))
        return self._comms[-1]

    def _destroy_parts(self, outcome: str | None = None) -> None:
        """Give back what was built (only what exists after a failed start: ``outcome`` None), in order."""
        atexit.unregister(self._finish_at_exit)  # a no-op if it was not registered

        def records() -> None:  # the attempt's end, then the sinks' close (the journal's last copy to a URL
            if outcome is not None and self._runs is not None:  # root): under the lease, like every write
                self._runs.end(outcome)
            self.events.close()

        if (tiers := getattr(self, "_tiers", None)) is not None:  # uploads in flight or queued finish first
            tiers.close(raise_failure=False, before_release=records)
        if (preemption := getattr(self, "_preemption", None)) is not None:
            preemption.stop()  # previous signal handlers back, poller stopped
        records()  # (both idempotent)
        if (writers := getattr(self, "_writers", None)) is not None:
            writers.close()
        if (stager := getattr(self, "_stager", None)) is not None:
            stager.release()
        lease, self._lease = self._lease or self.layout.owner, None  # the layout's, if take_ownership failed
        if lease is not None:
            lease.release()
        for comm in self._comms:
            comm.destroy()
        self._held.release()

    def _build(
        self, durable: Any, keep: Keep, cluster: ClusterOptions, writer: WriterOptions, fallback: bool | None
    ) -> None:
        """The parts that need process groups (created here, in the same order on every rank)."""
        retention = keep.retention()
        timeout, writer_threads = cluster.collective_timeout_s, writer.threads
        self.comm = self._new_comm(timeout)
        self._agreement = self._schedule.attach(self.comm)
        # With tiering, local copies are pruned by the uploader (Keep.local_last); `retention` is durable's.
        kept = Retention() if durable is not None else retention
        verdicts = Verdicts()  # what restore verified, for retention (the newest intact step survives)
        # Retention on rank 0, on its deleter thread or after each save's verdict (policy/retainer.py).
        self._retainer = Retainer(self.layout, kept, verdicts, background=cluster.background_deletes)
        # One incremental history for both savers: a sync save links from an async one's step and back.
        history = History(full_every=writer.full_every) if writer.incremental else None
        self._retainer.keep_fallback = history is not None and writer.full_every > 0  # docs/reliability.md
        self._saver = SyncSaver(self.layout, self.comm, self._retainer, writer_threads, history=history)
        self._restorer = Restorer(self.layout, self.comm, verdicts)
        self._if_busy = writer.if_busy
        # The writer process: "process" starts it now, "auto" once a state pays (save/writer_choice.py).
        self._writers = WriterChoice(fallback)
        self._stager = self._writers.stager()
        self._writer = BackgroundWriter()
        # The writer thread runs collectives; it gets its own group so they never interleave with the
        # training thread's (maybe_save agreement, restore) on the same group.
        self._bg_comm = self._new_comm(timeout) if self._async else None
        self._bg_saver: SyncSaver | None = None
        if self._bg_comm is not None:
            wrap = self._writers.wrap(lambda: self._stager.arena)
            bg = (self.layout, self._bg_comm, self._retainer, writer_threads)
            self._bg_saver = SyncSaver(*bg, wrap_writer=wrap, history=history, staged=self._stager)
            self._bg_saver.pause = self._retainer.pause = self._writer.gate.pause  # save/foreground.py
        self._at_exit = self._async or durable is not None or self._retainer.in_background  # its deletes
        # The uploader's collectives get their own group too (created here: same order on every rank).
        self._tiers = SingleTier(self.layout)
        if durable is not None and isinstance(self.layout, Layout):  # per-node ones on several nodes
            args = (self.layout, durable, retention, keep.local_last, self._new_comm(timeout), verdicts)
            self._tiers = build_tiers(self.comm, [self._saver, self._bg_saver], *args)
        parts = (self._saver, self._bg_saver, self._restorer, self._retainer, self._tiers, self._resume)
        wire(self.events, *parts, rank=self.comm.rank)  # events.py: each part emits its phases

    def _take_ownership(self, stale_after_s: float) -> None:
        self._lease, error, self._read_only = take_ownership(
            self.comm, self.layout, self._tiers, self.root, stale_after_s, self._job
        )
        if error is not None:
            raise error  # __init__ gives back what was started
        self._tiers.start()

    # ---- saving --------------------------------------------------------------------------------------

    def maybe_save(self, step: int, state: TrainState, metrics: dict[str, Any] | None = None) -> bool:
        """Save if a policy says it is due. Returns whether a save happened: False also when
        ``if_busy="skip"`` skipped it (a time policy stays due; a step policy waits for its next step)."""
        opts.check_step(step)
        self._tiers.observe(step)  # durability_lag() counts steps trained since the last durable save
        self._journal.progress(step)  # the report's "steps redone" after a kill
        if self._emergency is not None and self._emergency.preemption.agreed(step):
            self._emergency.run(step, state, metrics)
        if not self._schedule.due(step):
            return False
        return self._save(step, state, metrics)[0]

    def save(
        self, step: int, state: TrainState, metrics: dict[str, Any] | None = None, *, overwrite: bool = False
    ) -> CheckpointInfo | None:
        """Save now (collective under torchrun). Raises SaveError if it failed; nothing is then committed.

        Returns the committed checkpoint (``async_save``: None once staged, a failure raised by a later call;
        the checkpoint if it was written synchronously, the previous one still writing: if_busy="auto").
        A ``step`` whose checkpoint the state already is (just saved by ``maybe_save``, or restored) is not
        written again: a warning says so (and that ``metrics`` given here are not recorded), and the committed
        checkpoint is returned, its metrics kept (None with ``async_save``). ``overwrite=True`` replaces it.
        """
        self._check_open()
        opts.check_step(step)
        if step == self._schedule.last_step and not overwrite:
            try:  # a background save of this step that failed was not committed: it is raised here
                self._writer.raise_failure()
            except BaseException:
                self._schedule.at(None)  # so that saving this step again writes it
                raise
            self._schedule.say_committed(step, bool(metrics), self.comm.is_coordinator)
            current = self._current
            return current if current is not None and current.step == step else None
        return self._save(step, state, metrics)[1]

    def _save(self, step: int, state: TrainState, metrics: dict[str, Any] | None) -> Saved:
        self._check_open()
        opts.check_step(step)
        if not isinstance(state, TrainState):
            raise ValueError(f"state must be a safepoint.TrainState, got {type(state).__name__}")
        self._writer.raise_failure()
        self._tiers.raise_failure()
        clean = clean_metrics(metrics)
        if self._async:
            return self._save_async(step, state, clean)
        return True, self._save_sync(step, state, clean)

    def _check_owner(self, step: int) -> None:
        """Collective: the same LeaseError on every rank for a root this manager may not write."""
        check_owner(self.comm, self._lease, self._read_only, step)

    def _save_sync(
        self,
        step: int,
        state: TrainState,
        metrics: dict[str, float],
        emergency: dict[str, str] | None = None,
        *,
        upload: bool = True,
    ) -> CheckpointInfo:
        self._check_owner(step)  # here: the emergency save (emergency.py) calls this directly
        call = SaveCall(self.events, step, is_async=False, emergency=emergency is not None)
        # Uploads hold off while training waits for this save; no cyclic GC during its per-item work.
        with self._tiers.paused(), call.failing(SaveError), gc_paused():
            t0 = call.begin()
            sd = state.capture(self.comm.rank)
            timings = {"capture_s": time.perf_counter() - t0}
            extra = {"emergency": emergency} if emergency is not None else None
            info = self._saver.write(step, sd, state.sections(), metrics, timings, extra)
        self._current = self._tiers.committed(info, upload=upload)  # queued for upload (tiering)
        self._schedule.saved(step, call.returned(directory=str(info.path)), info.bytes)
        return info

    def _save_async(self, step: int, state: TrainState, metrics: dict[str, float]) -> Saved:
        self._check_owner(step)
        call = SaveCall(self.events, step, is_async=True)
        room = self._writer.make_room(step, self._if_busy, self.comm)  # "wait" waits here, outside the gate
        with self._writer.gate.foreground():  # the loop's save first: background work waits (foreground.py)
            if room != "stage":  # "skip", or "sync": beside the one in flight (background.py: why it is safe)
                return (True, self._save_sync(step, state, metrics)) if room == "sync" else (False, None)
            saver = cast(SyncSaver, self._bg_saver)  # set when async
            with self._tiers.paused(), call.failing(SaveError), gc_paused():
                call.begin()
                spent: list[Any] = [state.capture(self.comm.rank)]  # freed on the writer thread (submit)
                staged = self._stager.stage(spent[0], call, self.comm.rank, spent)
            blocking = call.returned(bytes_written=self._stager.nbytes)  # counted when buffers were made
            parts, tiers, times = state.sections(), self._tiers, {"stage_s": blocking}
            self._writer.submit(
                step, lambda: tiers.committed(saver.write(step, staged, parts, metrics, times)), spent
            )
            self._schedule.saved(step, blocking, self._stager.nbytes)
        return True, None

    # ---- restoring -----------------------------------------------------------------------------------

    def restore(
        self,
        state: TrainState,
        step: int | None = None,
        *,
        strict: bool = True,
        ignore: Iterable[str] | None = None,
        remap: Callable[[str], str | None] | None = None,
    ) -> int:
        """Load the newest intact checkpoint (or exactly ``step``) into ``state``; returns its step, 0 if
        there is none. ``strict=False`` loads what matches; ``ignore``: key patterns never loaded;
        ``remap``: saved key -> state key. What was left is in ``last_restore`` (restore/partial.py)."""
        self._check_open()
        if not isinstance(state, TrainState):
            raise ValueError(f"state must be a safepoint.TrainState, got {type(state).__name__}")
        opts.check_step(step, optional=True)
        self._writer.wait()
        self._writer.raise_failure()
        self._retainer.drain()  # no delete races the choice of what to load
        with gc_paused():  # per-item work: no cyclic collections over it (store/gc_pause.py)
            manifest, self.last_restore = self._resume.restore(
                self.comm, step, state, self._tiers, self._restorer, Selection.of(strict, ignore, remap)
            )
        if manifest is None:
            return 0
        self._schedule.at(manifest.step)
        self._current = self.layout.info(manifest.step, manifest)
        log.info("safepoint: restored step %d from %s", manifest.step, self.layout.step_path(manifest.step))
        return manifest.step

    # ---- listing -------------------------------------------------------------------------------------

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints (of both tiers), oldest first (manifests parsed; the CLI's verify checks)."""
        return self._tiers.list()

    def durability_lag(self) -> DurabilityLag:
        """Steps and seconds of training not yet covered by a durable checkpoint (see tiering.py)."""
        return self._tiers.lag()

    def latest_step(self) -> int | None:
        infos = self.list()
        return infos[-1].step if infos else None

    # ---- lifecycle -----------------------------------------------------------------------------------

    def wait(self) -> None:
        """Block until no save, delete or upload is in flight; raise a background save's failure, if any."""
        self._check_open()
        self._writer.wait()
        self._writer.raise_failure()
        self._retainer.drain()
        self._tiers.wait()
        self._tiers.raise_failure()

    def _finish_at_exit(self) -> None:
        if self._writer.busy:
            log.info("safepoint: interpreter exiting; waiting for the save in flight")
        self._writer.wait()
        self._retainer.drain()  # deletes queued by the last saves, under the lease this process holds
        self._tiers.wait()  # and for uploads: the last checkpoint is the one a restart needs

    def close(self) -> None:
        """Wait for the save in flight, then release the root. Raises a background failure, if any."""
        if self._closed:
            return
        self._closed = True
        try:
            self._writer.wait()
            self._writer.raise_failure()
        finally:
            self._retainer.close()  # queued deletes finish while this process still holds the lease
            self._destroy_parts(outcome_of(None))
        self._tiers.raise_failure()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._runs is not None:
            self._runs.end(outcome_of(exc))  # an exception out of the loop is a failure for the MTBF
        try:
            self.close()
        except Exception as e:  # a background failure must not replace the exit code of the notice
            if not isinstance(exc, Preempted):
                raise
            log.error("safepoint: while exiting on the preemption notice: %s", e)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed")
