"""The background half of an async save: write, checksum, commit and retain on a writer thread.

One save in flight at a time. A failure is logged the moment it happens and kept until the next call into
the manager raises it; the failed save is never committed (SyncSaver guarantees that).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from safepoint.errors import SaveError
from safepoint.layout import CheckpointInfo

log = logging.getLogger("safepoint")


class BackgroundWriter:
    def __init__(self) -> None:
        self._future: Future[CheckpointInfo] | None = None
        self._step: int | None = None
        self._failure: BaseException | None = None
        self.completed: list[CheckpointInfo] = []

    @property
    def busy(self) -> bool:
        return self._future is not None and not self._future.done()

    def submit(self, step: int, work: Callable[[], CheckpointInfo]) -> None:
        assert not self.busy, "one save in flight"
        fut: Future[CheckpointInfo] = Future()
        self._future, self._step = fut, step

        def run() -> None:
            try:
                fut.set_result(work())
            except BaseException as e:  # every failure must reach the user
                log.error("safepoint: background save of step %d failed: %s", step, e)
                fut.set_exception(e)

        # A daemon thread: a process that exits without close() simply never commits this save.
        threading.Thread(target=run, name=f"safepoint-save-{step}", daemon=True).start()

    def wait(self) -> float:
        """Block until the save in flight (if any) finishes; return seconds waited. Does not raise."""
        if self._future is None:
            return 0.0
        t0 = time.perf_counter()
        try:
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
