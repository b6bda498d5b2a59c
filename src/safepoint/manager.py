"""CheckpointManager: composes capture, write, commit, retain and restore. Holds no I/O details itself."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import time
from types import TracebackType
from typing import Any

from safepoint.background import BackgroundWriter
from safepoint.dist import Comm
from safepoint.errors import CheckpointError
from safepoint.layout import CheckpointInfo, Layout
from safepoint.lease import Lease
from safepoint.manifest import clean_metrics
from safepoint.policy import EveryNSeconds, EveryNSteps, SavePolicy, build_retention
from safepoint.restore import Restorer
from safepoint.saver import SyncSaver
from safepoint.staging import Stager, tensor_bytes
from safepoint.state import TrainState

log = logging.getLogger("safepoint")


@dataclasses.dataclass(slots=True)
class SaveRecord:
    """One save as the training loop saw it."""

    step: int
    blocking_s: float
    bytes: int


class CheckpointManager:
    """Saves a TrainState atomically and verifiably; restores the newest intact checkpoint.

    Args:
        root: checkpoint directory (created if missing).
        save_every_steps: ``maybe_save`` saves when ``step`` is a multiple of this.
        save_every_seconds: ``maybe_save`` saves when this many seconds passed since the last save
            (ranks agree: due on all or on none).
        keep_last / keep_every_steps / keep_best (+ best_metric, best_mode): retention; the union of
            what each keeps survives, and the newest checkpoint always does. None of them: keep all.
        collective_timeout_s: bound on every collective safepoint runs among ranks.
        writer_threads: DCP writer threads per rank.
        lease_stale_after_s: a lease whose heartbeat is older than this (other host) is taken over.
        async_save: ``save``/``maybe_save`` block only while the state is copied into reused host buffers;
            writing, checksums, commit and retention run on a background thread.
        if_busy: with async_save, what a save does while the previous one is still writing: "wait"
            (default; logs how long) or "skip" (warns, saves nothing). Never two staged copies.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        save_every_steps: int | None = None,
        save_every_seconds: float | None = None,
        keep_last: int | None = None,
        keep_every_steps: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        collective_timeout_s: float = 600.0,
        writer_threads: int = 1,
        lease_stale_after_s: float = 120.0,
        async_save: bool = False,
        if_busy: str = "wait",
    ) -> None:
        self.root = _local_root(root)
        self._save_policies: list[SavePolicy] = []
        if save_every_steps is not None:
            self._save_policies.append(EveryNSteps(save_every_steps))
        if save_every_seconds is not None:
            self._save_policies.append(EveryNSeconds(save_every_seconds))
        self._time_based = save_every_seconds is not None
        retention = build_retention(keep_last, keep_every_steps, keep_best, best_metric, best_mode)
        if not isinstance(writer_threads, int) or writer_threads < 1:
            raise ValueError(f"writer_threads must be a positive int, got {writer_threads!r}")
        if if_busy not in ("wait", "skip"):
            raise ValueError(f"if_busy must be 'wait' or 'skip', got {if_busy!r}")
        if collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s must be positive, got {collective_timeout_s!r}")
        self.layout = Layout(self.root)
        self.comm = Comm(collective_timeout_s)
        self._saver = SyncSaver(self.layout, self.comm, retention, writer_threads=writer_threads)
        self._restorer = Restorer(self.layout, self.comm)
        self._async = bool(async_save)
        self._if_busy = if_busy
        self._stager = Stager()
        self._writer = BackgroundWriter()
        # The writer thread runs collectives; it gets its own group so they never interleave with the
        # training thread's (maybe_save agreement, restore) on the same group.
        self._bg_comm = Comm(collective_timeout_s) if self._async else None
        self._bg_saver = (
            SyncSaver(self.layout, self._bg_comm, retention, writer_threads=writer_threads)
            if self._bg_comm is not None
            else None
        )
        if self._async:
            # A script that ends without close() must not kill the writer mid-file at interpreter
            # shutdown (torch's C++ writer aborts the process then): let the save in flight finish.
            atexit.register(self._finish_at_exit)
        self._lease: Lease | None = None
        self._last_step: int | None = None
        self._last_time = time.monotonic()
        self.saves: list[SaveRecord] = []
        self._closed = False
        self._take_ownership(lease_stale_after_s)

    def _take_ownership(self, stale_after_s: float) -> None:
        error: CheckpointError | None = None
        if self.comm.is_coordinator:
            try:
                self.layout.ensure_root()
                self._lease = Lease(self.layout.root, stale_after_s=stale_after_s)
                self._lease.acquire()
                for line in self.layout.clean_pending():
                    log.info("safepoint: %s", line)
            except CheckpointError as e:
                error = e
            except OSError as e:
                error = CheckpointError(f"cannot use checkpoint root {self.root}: {e}")
        error = self.comm.broadcast(error)
        if error is not None:
            if self._lease is not None:
                self._lease.release()
            self.comm.destroy()
            self._closed = True
            raise error

    # ---- saving --------------------------------------------------------------------------------------

    def maybe_save(self, step: int, state: TrainState, metrics: dict[str, Any] | None = None) -> bool:
        """Save if a policy says it is due. Returns whether a save happened."""
        self._check_step(step)
        if step == self._last_step or not self._save_policies:
            return False
        now = time.monotonic()
        due = any(p.due(step, now, self._last_step, self._last_time) for p in self._save_policies)
        if self._time_based and self.comm.distributed:
            # Clocks differ between ranks; a save due on some ranks only would deadlock the collective.
            due = self.comm.broadcast(due)
        if not due:
            return False
        self.save(step, state, metrics)
        return True

    def save(
        self, step: int, state: TrainState, metrics: dict[str, Any] | None = None
    ) -> CheckpointInfo | None:
        """Save now (collective under torchrun). Raises SaveError if it failed; nothing is then committed.

        Returns the committed checkpoint; with ``async_save`` returns None once the state is staged (a
        failure in the background is raised by the next save/maybe_save/wait/close).
        """
        self._check_open()
        self._check_step(step)
        if not isinstance(state, TrainState):
            raise ValueError(f"state must be a safepoint.TrainState, got {type(state).__name__}")
        if self._lease is not None:
            self._lease.check()
        self._writer.raise_failure()
        clean = clean_metrics(metrics)
        if self._async:
            self._save_async(step, state, clean)
            return None
        t0 = time.perf_counter()
        sd = state.capture(self.comm.rank)
        info = self._saver.write(step, sd, state.sections(), clean, {"capture_s": time.perf_counter() - t0})
        self.saves.append(SaveRecord(step=step, blocking_s=time.perf_counter() - t0, bytes=info.bytes))
        self._last_step = step
        self._last_time = time.monotonic()
        return info

    def _save_async(self, step: int, state: TrainState, metrics: dict[str, float]) -> None:
        busy = self._writer.busy
        if self._if_busy == "skip":
            if self.comm.distributed:
                busy = self.comm.any(busy)  # all ranks skip together, or none does
            if busy:
                log.warning("safepoint: skipping save of step %d: the previous save is still writing", step)
                return
        elif busy:
            waited = self._writer.wait()
            log.info("safepoint: waited %.2fs for the previous save before saving step %d", waited, step)
            self._writer.raise_failure()
        assert self._bg_saver is not None
        saver = self._bg_saver
        t0 = time.perf_counter()
        staged = self._stager.stage(state.capture(self.comm.rank))
        blocking = time.perf_counter() - t0
        sections = state.sections()
        self._writer.submit(step, lambda: saver.write(step, staged, sections, metrics, {"stage_s": blocking}))
        self.saves.append(SaveRecord(step=step, blocking_s=blocking, bytes=tensor_bytes(staged)))
        self._last_step = step
        self._last_time = time.monotonic()

    # ---- restoring -----------------------------------------------------------------------------------

    def restore(self, state: TrainState, step: int | None = None) -> int:
        """Load the newest intact checkpoint (or exactly ``step``) into ``state``.

        Returns the number of steps completed in the restored checkpoint, 0 if there is none.
        """
        self._check_open()
        if not isinstance(state, TrainState):
            raise ValueError(f"state must be a safepoint.TrainState, got {type(state).__name__}")
        if step is not None:
            self._check_step(step)
        self._writer.wait()
        self._writer.raise_failure()
        manifest = self._restorer.choose(step)
        if manifest is None:
            return 0
        self._restorer.load(manifest, state)
        self._last_step = manifest.step
        self._last_time = time.monotonic()
        log.info("safepoint: restored step %d from %s", manifest.step, self.layout.step_path(manifest.step))
        return manifest.step

    # ---- listing -------------------------------------------------------------------------------------

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first (manifests parsed; use the CLI's verify for full checks)."""
        out = []
        for s in self.layout.committed_steps():
            try:
                out.append(self.layout.info(s, self.layout.read_manifest(s)))
            except CheckpointError as e:
                log.warning("safepoint: not listing step %d: %s", s, e)
        return out

    def latest_step(self) -> int | None:
        infos = self.list()
        return infos[-1].step if infos else None

    # ---- lifecycle -----------------------------------------------------------------------------------

    def wait(self) -> None:
        """Block until no save is in flight; raise the failure of a background save, if any."""
        self._check_open()
        self._writer.wait()
        self._writer.raise_failure()

    def _finish_at_exit(self) -> None:
        if self._writer.busy:
            log.info("safepoint: interpreter exiting; waiting for the save in flight")
        self._writer.wait()

    def close(self) -> None:
        """Wait for the save in flight, then release the root. Raises a background failure, if any."""
        if self._closed:
            return
        self._closed = True
        if self._async:
            atexit.unregister(self._finish_at_exit)
        try:
            self._writer.wait()
            self._writer.raise_failure()
        finally:
            self._stager.release()
            if self._lease is not None:
                self._lease.release()
                self._lease = None
            if self._bg_comm is not None:
                self._bg_comm.destroy()
            self.comm.destroy()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed")

    @staticmethod
    def _check_step(step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")


def _local_root(root: str | os.PathLike[str]) -> str:
    if not isinstance(root, (str, os.PathLike)) or not str(root):
        raise ValueError(f"root must be a non-empty path, got {root!r}")
    s = os.fspath(root)
    if s.startswith("file://"):
        s = s[len("file://") :]
    elif "://" in s:
        raise ValueError(f"root {s!r}: only local and network file system paths are supported by this build")
    return s
