"""upload_grace: the preemption's grace as the uploader (tiering.py) sees it: the deadline close() waits
for, the abandon of an upload still running then, and the commit lock that keeps the two exclusive."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("safepoint")


class UploadGrace:
    """Shares the uploader's condition (``cv``); ``gate`` / ``abandoned``: the durable store's events."""

    def __init__(self, cv: threading.Condition, gate: threading.Event, abandoned: threading.Event) -> None:
        self._cv, self._gate, self._abandoned = cv, gate, abandoned
        self.deadline: float | None = None  # the grace's end (monotonic): close() waits no longer
        self.gave_up = False  # close() abandoned the upload in flight at the deadline
        # Held across a durable commit (manifest PUT, promote): abandoning waits for it (up to the deadline),
        # and once abandoned no commit starts. So the lease is never given up under a commit.
        self._commit_lock = threading.Lock()
        self.commit_running: int | None = None  # the step whose commit was running when abandoned

    def remaining(self) -> float | None:
        """Seconds until the grace ends (None: no deadline; may be negative)."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def release_lease(self, lease: Any) -> None:
        """Give the durable root back; after a notice, waiting no longer than the grace (what is not done by
        then finishes in the background, or the lease expires by itself: lease_stale_after_s, at once for a
        restart on this host). Never under a commit left running at the deadline: that lease only stops."""
        if lease is None:
            return
        if self.commit_running is not None:
            lease.stop()
            log.warning(
                "safepoint: not releasing the durable root's lease under the commit of step %s (it expires "
                "after lease_stale_after_s; a restart on this host takes it over at once)",
                self.commit_running,
            )
            return
        remaining = self.remaining()
        if not lease.release(timeout=None if remaining is None else max(0.0, remaining)):
            log.warning(
                "safepoint: the durable root's lease was not released by the end of the grace; if the "
                "process exits first, it expires after lease_stale_after_s (a restart on this host takes it "
                "over at once)"
            )

    def abandon(self, stop: Callable[[], int | None]) -> None:
        """The grace ends with an upload still running: leave it rather than be SIGKILLed waiting. No new
        request starts (the gate stays shut) and no commit starts, so the durable tier gets nothing from it;
        the next owner deletes the partial objects and uploads the step again from the local copy. A commit
        already running (its manifest PUT, a promote) is waited for until the deadline at most; if it is
        still running then, it is left to finish (it may or may not land) and the lease is not released.
        ``stop`` runs under ``cv``: it keeps further uploads from starting and returns the step in flight."""
        remaining = self.remaining()
        got = self._commit_lock.acquire(timeout=max(0.0, remaining) if remaining is not None else -1)
        try:
            with self._cv:
                busy = stop()
                self.gave_up = True  # checked under the commit lock: no commit starts from here on
                if not got:
                    self.commit_running = busy
            self._gate.clear()
            self._abandoned.set()
        finally:
            if got:
                self._commit_lock.release()
        if got:
            log.error(
                "safepoint: the grace is over and the upload of step %s is still running: abandoned (nothing "
                "is committed on the durable tier; the next run uploads it again from the local copy)",
                busy,
            )
        else:
            log.error(
                "safepoint: the grace is over while step %s is being committed on the durable tier: the "
                "commit is left running (it may or may not complete before the process exits; the next run "
                "keeps it if it did, and uploads the step again from the local copy if not)",
                busy,
            )

    @contextlib.contextmanager
    def committing(self) -> Iterator[bool]:
        """Around a durable commit: yields whether it may start (False once abandoned)."""
        with self._commit_lock:
            yield not self.gave_up
