"""Preemption notice sources: a signal, a sentinel file, a polled callable. Each only sets a flag."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any, Protocol

log = logging.getLogger("safepoint")


class Notice:
    """The one flag every source sets. First notice wins; setting is idempotent."""

    __slots__ = ("at", "reason")

    def __init__(self) -> None:
        self.reason: str | None = None
        self.at: float | None = None  # time.monotonic() when the notice arrived

    def set(self, reason: str, at: float | None = None) -> None:
        # Plain attribute stores only: safe from a signal handler and from the poller thread. A race
        # between two first notices can only mix which reason is shown, never lose the notice.
        if self.at is None:
            self.reason = reason
            self.at = time.monotonic() if at is None else at

    @property
    def is_set(self) -> bool:
        return self.at is not None


class NoticeSource(Protocol):
    """Where a preemption notice can come from. ``start`` and ``stop`` run once; ``check`` runs in the
    training thread at every ``maybe_save`` and must be cheap (microseconds)."""

    def start(self, notice: Notice) -> None: ...
    def check(self) -> None: ...
    def stop(self) -> None: ...


_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class SignalNotice:
    """Signals (SIGTERM, SIGUSR1, ...): the handler sets the flag, then calls the previous Python handler.

    Previous handlers are restored by ``stop``. ``SIG_DFL``/``SIG_IGN`` are not "called" (calling SIG_DFL
    would mean dying without the save); a previous Python callable is, after the flag is set.
    """

    def __init__(self, signals: Iterable[int | signal.Signals]) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        if not self.signals:
            raise ValueError("PreemptionOptions.signals is empty")
        if signal.SIGKILL in self.signals or signal.SIGSTOP in self.signals:
            raise ValueError("SIGKILL and SIGSTOP cannot be caught; they cannot be preemption notices")
        self._previous: dict[signal.Signals, _Handler] = {}
        self._notice: Notice | None = None
        self._check_main_thread()

    @staticmethod
    def _check_main_thread() -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "PreemptionOptions.signals: Python installs signal handlers only from the main thread, and "
                f"this CheckpointManager is created in thread {threading.current_thread().name!r}. Create it "
                "in the main thread, or use PreemptionOptions(file=...) or (poll=...), which work from any "
                "thread."
            )

    def start(self, notice: Notice) -> None:
        self._check_main_thread()
        self._notice = notice
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread between two bytecodes of whatever it was doing: set the flag and return.
        # No logging (its locks may be held by the interrupted code), no I/O, no collectives.
        sig = signal.Signals(signum)
        if self._notice is not None:
            self._notice.set(sig.name)
        previous = self._previous.get(sig)
        if callable(previous):
            previous(signum, frame)

    def check(self) -> None:
        pass

    def stop(self) -> None:
        for sig, previous in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):  # not the main thread: cannot restore
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()


class FileNotice:
    """A sentinel file: its existence means preempted (a Kubernetes preStop hook ``touch``-es it).

    A file already present when the manager starts is left over from an earlier attempt (a container
    restarted in the same pod keeps its emptyDir): it is removed (or, if that fails, ignored while
    unchanged) so a restarted job does not exit at once. The notice's age is taken from the file's mtime,
    so the grace clock starts when the hook ran, not when the loop happened to look.
    """

    MIN_CHECK_INTERVAL_S = 0.05  # bound the stat() rate on slow file systems

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        if not self.path:
            raise ValueError("preemption_file is empty")
        self._stale: tuple[int, int] | None = None
        self._next_check = 0.0
        self._notice: Notice | None = None

    def start(self, notice: Notice) -> None:
        self._notice = notice
        try:
            st = os.stat(self.path)
        except OSError:
            return
        try:
            os.remove(self.path)
            log.warning("safepoint: removed stale preemption file %s (left by an earlier attempt)", self.path)
        except OSError as e:
            self._stale = (st.st_ino, st.st_mtime_ns)
            log.warning("safepoint: ignoring stale preemption file %s (cannot remove it: %s)", self.path, e)

    def check(self) -> None:
        now = time.monotonic()
        if self._notice is None or self._notice.is_set or now < self._next_check:
            return
        self._next_check = now + self.MIN_CHECK_INTERVAL_S
        try:
            st = os.stat(self.path)
        except OSError:
            return
        if self._stale == (st.st_ino, st.st_mtime_ns):
            return
        age = min(max(0.0, time.time() - st.st_mtime), 3600.0)
        self._notice.set(f"file {self.path}", at=now - age)

    def stop(self) -> None:
        pass


class PollNotice:
    """A callable polled in a background thread (e.g. a cloud metadata endpoint); truthy means preempted.

    It is called at once, then every ``interval_s`` seconds, until it returns truthy or the manager closes.
    An exception in it is logged (with its traceback the first time) and polling goes on.
    """

    def __init__(self, fn: Callable[[], object], interval_s: float = 5.0) -> None:
        if not callable(fn):
            raise ValueError(f"preemption_poll must be callable, got {fn!r}")
        if not (isinstance(interval_s, (int, float)) and interval_s > 0):
            raise ValueError(f"preemption_poll_interval_s must be positive, got {interval_s!r}")
        self.fn = fn
        self.interval_s = float(interval_s)
        self.name = getattr(fn, "__qualname__", None) or repr(fn)
        self.failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, notice: Notice) -> None:
        self._thread = threading.Thread(
            target=self._run, args=(notice,), name="safepoint-preemption-poll", daemon=True
        )
        self._thread.start()

    def _run(self, notice: Notice) -> None:
        while not self._stop.is_set():
            try:
                if self.fn():
                    notice.set(f"poll {self.name}")
                    return
            except Exception as e:
                self.failures += 1
                if self.failures & (self.failures - 1) == 0:  # 1st, 2nd, 4th, 8th, ...: bounded log volume
                    log.warning(
                        "safepoint: preemption poll %s failed (%d time(s) so far): %r",
                        self.name,
                        self.failures,
                        e,
                        exc_info=self.failures == 1,
                    )
            self._stop.wait(self.interval_s)

    def check(self) -> None:
        pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)  # a callable stuck on the network must not block close()


# ---- what an emergency save can afford -------------------------------------------------------------------
