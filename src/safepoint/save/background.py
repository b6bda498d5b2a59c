"""The background half of an async save: write, checksum, commit and retain on a writer thread.

One save in flight at a time. A failure is logged the moment it happens and kept until the next call into
the manager raises it; the failed save is never committed (SyncSaver guarantees that).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from safepoint.dist import Comm
from safepoint.errors import SaveError
from safepoint.save.foreground import ForegroundGate
from safepoint.store.posix_layout import CheckpointInfo

log = logging.getLogger("safepoint")

# The writer thread runs this much "nicer" than the thread that started it, so training wins the CPU when
# both want it: the write only has to finish before the next save, training steps are what the user waits
# for. On Linux nice applies per thread (a thread id is a valid PRIO_PROCESS target) and threads the writer
# starts (DCP's extra writer threads, the crc32c helper) inherit it. Not 19: under a training loop that
# keeps every core busy, nice 19 gets ~1.5% of a core against nice 0 and the write could take longer than
# the save interval; nice 10 gets ~10%, and any idle CPU time (the loop's own I/O, data loading, syncs) at
# full speed. Elsewhere (no per-thread nice) the writer runs at normal priority.
WRITER_NICE = 10


def lower_thread_priority(increment: int | None = None) -> None:
    """Make the calling thread ``increment`` nicer (default WRITER_NICE, read at the call); Linux only."""
    if increment is None:
        increment = WRITER_NICE
    if not sys.platform.startswith("linux") or increment <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except OSError as e:  # a sandbox may forbid it: slower training, not a failed save
        log.debug("safepoint: could not lower the writer thread's priority: %s", e)


class BackgroundWriter:
    def __init__(self) -> None:
        self._future: Future[CheckpointInfo] | None = None
        self._step: int | None = None
        self._failure: BaseException | None = None
        self.completed: list[CheckpointInfo] = []
        # What saves did while the previous one was still writing (if_busy): skipped ("skip"), written
        # synchronously beside it ("auto"), or waited for it ("wait").
        self.skipped = self.synced = self.waited = 0
        self._synced_for: int | None = None  # the save in flight whose sync saves were logged
        # Held while a save is written beside the one in flight: that one's threads wait (foreground.py).
        self.gate = ForegroundGate()

    @property
    def busy(self) -> bool:
        return self._future is not None and not self._future.done()

    def submit(self, step: int, work: Callable[[], CheckpointInfo], spent: list[Any] | None = None) -> None:
        """Run ``work`` on a writer thread. ``spent``: what the save's blocking part made and no longer
        needs (the captured state dict, staging's walk), freed there first rather than on the loop's
        thread (at 9,000 tensors ~3.5 ms of deallocation per save: detached tensors, signature tuples)."""
        assert not self.busy, "one save in flight"
        fut: Future[CheckpointInfo] = Future()
        self._future, self._step = fut, step

        def run() -> None:
            if spent is not None:
                # A pause point (save/foreground.py): the caller's ``save()`` holds the gate until submit
                # has returned, and one C-level clear holds the GIL throughout: not while ``save()`` runs.
                self.gate.pause()
                spent.clear()
            lower_thread_priority()
            try:
                fut.set_result(work())
            except BaseException as e:  # every failure must reach the user
                log.error("safepoint: background save of step %d failed: %s", step, e)
                fut.set_exception(e)

        # A daemon thread: a process that exits without close() simply never commits this save.
        threading.Thread(target=run, name=f"safepoint-save-{step}", daemon=True).start()

    def make_room(self, step: int, if_busy: str, comm: Comm) -> str:
        """Before a new save of ``step``, with the previous one still writing: "stage" when none is (or
        ``if_busy`` "wait": once it is done; raises its failure), "skip" (``if_busy`` "skip"), or "sync"
        (``if_busy`` "auto": write this one synchronously now, beside the one in flight). Under torchrun
        every rank gets the same answer (one is busy: all skip, or all save synchronously)."""
        busy = self.busy
        if if_busy in ("skip", "auto"):
            if comm.distributed:
                busy = comm.any(busy)  # all ranks skip (or save synchronously) together, or none does
            if not busy:
                return "stage"
            if if_busy == "skip":
                log.warning("safepoint: skipping save of step %d: the previous save is still writing", step)
                self.skipped += 1
                return "skip"
            # Why a sync save beside the write in flight is safe: it writes the live state (no second
            # staged copy, so host memory does not grow) into its own pending directory under its own save
            # id, through the training thread's saver and group (the writer thread has its own: their
            # collectives never interleave); each commit is fenced by the lease and atomic on its own;
            # retention never deletes a step being committed (Retainer.claim) nor the newest one; the
            # incremental history links only files whose fingerprints match, from whichever step committed
            # last. It blocks the loop for a sync save's time: never longer, which waiting for the rest of
            # the write (then staging) can be when saves come faster than they are written. The caller
            # writes it holding ``gate``: the save in flight waits meanwhile, not competing for the GIL.
            if self._synced_for != self._step:  # one line per write in flight, not one per step
                log.info(
                    "safepoint: saving step %d synchronously: the previous save (step %s) is still writing",
                    step, self._step,
                )  # fmt: skip
                self._synced_for = self._step
            self.synced += 1
            return "sync"
        if busy:
            self.waited += 1
            waited = self.wait()
            log.info("safepoint: waited %.2fs for the previous save before saving step %d", waited, step)
            self.raise_failure()
        return "stage"

    def wait(self) -> float:
        """Block until the save in flight (if any) finishes; return seconds waited. Does not raise."""
        if self._future is None:
            return 0.0
        t0 = time.perf_counter()
        try:
            with self.gate.opened():  # the training thread holding the gate: the save must not stay parked
                self.completed.append(self._future.result())
        except BaseException as e:
            self._failure = e
        self._future = None
        return time.perf_counter() - t0

    def raise_failure(self) -> None:
        """Raise (once) the failure of a finished background save."""
        if self._future is not None and self._future.done():
            self.wait()
        failure, self._failure = self._failure, None
        if failure is None:
            return
        if isinstance(failure, SaveError):
            raise failure
        raise SaveError(
            f"background save of step {self._step} failed and was not committed: {failure!r}"
        ) from failure
