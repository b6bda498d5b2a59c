"""async_writer="process": the file writes of async saves run in a long-lived writer process per rank.

Why: the writer thread shares the training process's GIL. Serializing, checksumming and writing a
checkpoint take it in many short slices, and each slice can hold the training thread's next kernel
launch or data-loader hand-off. A process has its own interpreter.

How (and why not DCP's ``AsyncCheckpointerType.PROCESS``, measured in benchmarks/bench_async.py: it starts
its process with torch.multiprocessing spawn, which re-imports the user's script and costs seconds per job,
and copies the staged state a second time into shared memory on every save):
- the process starts with the manager, in the background (``python -c`` with a launch line that calls
  ``safepoint.save.writer_child.main``: nothing of the user's script is imported), and lives until
  ``close()``;
- the staging buffers are one shared-memory segment (shared_buffers.py); the process maps it once, so a
  save sends only DCP's plan and, per item, where its bytes lie, and for a save of an unchanged state not
  even that: the process keeps the last description and gets the values of the by-value items only
  (handoff.py). No copy beyond the staging one;
- everything collective (planning, metadata, commit, retention) stays in the rank's background thread:
  only the per-rank ``write_data`` moves to the process (process_writer.py), through SafepointWriter as
  before (crc32c as the bytes pass, fsync).
A writer process that dies (OOM killer, kill -9) fails that save, which is not committed; the next save
starts a new process.

A save never waits for the process to start (it imports torch: seconds on a loaded node; waiting stalled
the loop at its second save): until it reports ready, the writer thread writes (the same SafepointWriter:
same files, checksums, commit).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from safepoint.save import background, ipc
from safepoint.save.handoff import Arranged, Place, Sent
from safepoint.save.shared_buffers import SharedArena

log = logging.getLogger("safepoint")

CHILD_MODULE = "safepoint.save.writer_child"
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
"""The directory holding the ``safepoint`` package this module belongs to (src/safepoint/save/ -> src)."""
# Before anything else (importing torch takes seconds, minutes on a thrashing node): ignore the group's
# SIGINT/SIGTERM (a Ctrl-C or a scheduler's SIGTERM to the process group is the rank's to act on), and
# where the rank's main thread started us, die with the rank (PR_SET_PDEATHSIG), then
# check the rank did not die before that (argv[2] is its pid). The child's own poll covers the rest. Then
# take the writer's priority (argv[3]) before importing torch: that import is seconds of a core, and at the
# rank's priority it took the CPU from training while the rank's first saves ran (issue 27: a loop saving
# every step blocked ~2.8x a sync save for as long as it lasted; docs/benchmarks.md, round 6).
_LAUNCH = (
    "import signal as s; s.signal(s.SIGINT, s.SIG_IGN); s.signal(s.SIGTERM, s.SIG_IGN); "
    "import os, sys; "
    "os.environ.pop('SAFEPOINT_WRITER_DEATHSIG', '') == '1' and __import__('ctypes').CDLL(None).prctl(1, 9); "
    "os.getppid() == int(sys.argv[2]) or os._exit(1)\n"
    "try: n, p = int(sys.argv[3]), os.PRIO_PROCESS; os.getpriority(p, 0) < n and os.setpriority(p, 0, n)\n"
    "except (OSError, AttributeError): pass  # a sandbox may forbid it: slower training, not a failed save\n"
    "from {module} import main; sys.exit(main(sys.argv))"
)
_POLL_S = 1.0  # how often a wait for the process checks that it is still alive
_WHILE = {
    "write": "while writing",
    "again": "while writing",
    "arena": "while mapping the staging memory",
    "drop": "while unmapping it",
}
# Starting the process imports torch: seconds on a loaded node, minutes on a thrashing one. It starts with
# the manager, so this only bounds the wait of a first save that comes before the process is ready.
START_TIMEOUT_S = 300.0


class WriterProcessError(OSError):
    """The writer process failed to start, or died while writing (the save is not committed)."""


class WriterUnavailable(WriterProcessError):
    """No writer process could start and the manager may fall back to the writer thread ("auto")."""


class WriterStarting(WriterUnavailable):
    """The writer process has not reported ready yet: the calling thread writes this save itself."""


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class WriterProcess:
    """One writer process (started at once, in the background) and the channel to it.

    Every message gets exactly one reply, so a failure anywhere in an exchange cannot leave a reply behind
    for the next one: an exchange that does not complete ends the process (the next save starts another).
    """

    def __init__(self, *, fallback: bool = False) -> None:
        # fallback: a process that cannot start makes every later write run on the calling thread
        # (``unavailable`` says why) instead of failing each save.
        self.fallback = fallback
        self.unavailable: str | None = None
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._ready = False
        self._arena_sent: str | None = None
        self._held: Sent | None = None  # the save description the process holds (handoff.py)
        self._keys = 0
        self._killed: str | None = None  # why we killed the process, when we did
        # Relative to the thread that creates the manager (not to the writer thread, already at +10, that
        # may restart the process later).
        self._nice = min(19, _current_nice() + max(0, background.WRITER_NICE))
        self.started = 0  # processes started so far (a dead one is replaced at the next save)
        self._started_at = 0.0  # time.monotonic() of the last start
        self.writes = 0  # writes done by a process
        self.thread_writes = 0  # writes done by the calling thread while the process was starting
        self.descriptions = 0  # full descriptions sent (the other writes sent "same as last time")
        self.stale = 0  # "same as last time" answered "stale" (the process did not hold it)
        self.same_results = 0  # writes whose results equalled the last save's (not sent back)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the process without waiting for it (it imports torch meanwhile)."""
        try:
            self._start()
        except WriterProcessError as e:
            self._cannot_start(e)

    def _cannot_start(self, e: WriterProcessError) -> None:
        """Without ``fallback`` re-raise; with it, every later write runs on the calling thread."""
        if not self.fallback:
            raise e
        self.unavailable = str(e)
        log.warning("safepoint: %s; async saves are written on a background thread instead", e)

    def _start(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        # The process only reads host memory: no CUDA context (memory on every GPU, seconds to create).
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["OMP_NUM_THREADS"] = "1"  # torch.save needs no intra-op threads; training needs the cores
        # The kernel's death signal fires when the *thread* that started us ends: only the main thread's
        # lifetime is the rank's (a restart from the writer thread relies on the child's own poll).
        if sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread():
            env["SAFEPOINT_WRITER_DEATHSIG"] = "1"
        # Import this very safepoint, however the training script found it.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        args = [str(theirs.fileno()), str(os.getpid()), str(self._nice)]
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _LAUNCH.format(module=CHILD_MODULE), *args],
                pass_fds=[theirs.fileno()],
                env=env,
                stdin=subprocess.DEVNULL,
            )
        except BaseException as e:
            mine.close()
            if not isinstance(e, Exception):
                raise
            # OSError (no such interpreter, EAGAIN) or anything else Popen refuses (ValueError for a NUL in
            # an argument): either way no process, which "auto" answers with the writer thread.
            raise WriterProcessError(f"could not start the safepoint writer process: {e}") from e
        finally:
            theirs.close()
        self._sock, self._ready, self._arena_sent, self._killed = mine, False, None, None
        self._held = None
        self._started_at = time.monotonic()
        self.started += 1

    def write(
        self,
        arena: SharedArena | None,
        path: str,
        thread_count: int,
        plan: SavePlan,
        places: list[Place],
        values: list[Any],
        files: Arranged | None = None,
    ) -> tuple[list[WriteResult], dict[str, tuple[int, str]]]:
        """Have the process write one rank's items (``places`` and ``values`` from handoff.describe);
        returns DCP's write results and {file: (size, crc)}. ``files``: an incremental save's arrangement,
        [(file name, positions of its items in ``plan``)]: only those are written, into those files (None:
        every item, in DCP's own files).

        Raises WriterStarting while the process is still starting (never waits for it), and
        WriterUnavailable (with ``fallback``) if no process could be started for it.
        """
        with self._lock:
            if self.unavailable is not None:
                raise WriterUnavailable(self.unavailable)
            try:
                ready = self._check_ready(wait=False)
            except WriterProcessError as e:
                self._cannot_start(e)
                raise WriterUnavailable(str(e)) from e
            if not ready:
                self.thread_writes += 1
                raise WriterStarting("the writer process is still starting")
            if arena is not None and arena.id != self._arena_sent:
                self._held = None  # the process forgets its description with the old segment
                self._expect(self._request(("arena", arena.id, arena.nbytes), [arena.fd]), "ok")
                self._arena_sent = arena.id
            arena_id = arena.id if arena else None
            reply: tuple[Any, ...] | None = None
            held = self._held
            if held is not None and held.matches(plan, places, arena_id):
                reply = self._request(("again", held.key, arena_id, path, thread_count, values, files))
                if reply[0] == "stale":  # the process does not hold it after all: describe it again
                    self.stale += 1
                    reply = None
            if reply is None:  # nothing held, or a changed state (another plan, places or segment)
                self._held, self._keys = None, self._keys + 1
                msg = ("write", self._keys, arena_id, path, thread_count, plan, places, values, files)
                reply = self._request(msg)
                self.descriptions += 1
                if reply[0] == "done":  # the process holds it now (on failure, the next save resends)
                    self._held = Sent(self._keys, plan, places, arena_id)
            if reply[0] == "same" and self._held is not None and self._held.results is not None:
                reply = ("done", self._held.results, reply[1])  # what the last save of it produced
                self.same_results += 1
            elif reply[0] == "done" and self._held is not None:
                self._held.results = reply[1]
        if reply[0] == "done":
            self.writes += 1
            return reply[1], reply[2]
        if reply[0] != "failed":
            raise WriterProcessError(f"unexpected reply from the writer process: {reply[0]!r}")
        _, type_name, errno_, message, filename = reply
        if errno_ is not None:
            raise OSError(errno_, message, filename)  # PermissionError, ENOSPC...: as the thread raises them
        raise WriterProcessError(f"the writer process failed: {type_name}: {message}")

    def drop_arena(self) -> None:
        """Before the rank allocates new staging buffers: the process unmaps the old segment first, so
        two sets never exist at once (no save is in flight then)."""
        with self._lock:
            if self._arena_sent is None or self._sock is None:
                return
            self._held = None
            try:
                self._expect(self._request(("drop",)), "ok")
            except WriterProcessError as e:
                log.warning("safepoint: %s", e)  # the process is gone, and its mapping with it
            self._arena_sent = None

    def _request(self, msg: tuple[Any, ...], fds: list[int] | None = None) -> tuple[Any, ...]:
        """Send one message and wait for its reply, watching the process meanwhile. Holds the lock."""
        assert self._sock is not None and self._proc is not None
        try:
            ipc.send(self._sock, msg, fds)
            while not ipc.readable(self._sock, _POLL_S):
                # A copy of the channel inherited by a forked process (a DataLoader worker) would hide
                # the EOF of a dead writer: watch the process itself too.
                if self._proc.poll() is not None:
                    raise ipc.ChannelClosed("the writer process exited")
            reply, _ = ipc.recv(self._sock)
            return tuple(reply)
        except ipc.ChannelClosed:
            raise self._died(
                _WHILE.get(msg[0], "while busy"),
                "This save is not committed; the next save starts a new writer process.",
            ) from None
        except BaseException as e:
            # Half an exchange (an unpicklable reply, an interrupt): the channel can no longer be trusted.
            self._kill(f"the exchange with it failed ({e!r})")
            raise self._died(_WHILE.get(msg[0], "while busy"), "This save is not committed.") from e

    @staticmethod
    def _expect(reply: tuple[Any, ...], kind: str) -> None:
        if reply[0] != kind:
            raise WriterProcessError(f"unexpected reply from the writer process: {reply!r}")

    def wait_ready(self) -> None:
        """Block until the process has reported ready (starting one if none runs); raises
        WriterProcessError if it cannot start. Saves never call this; tests and benchmarks do."""
        with self._lock:
            self._check_ready(wait=True)

    def _check_ready(self, *, wait: bool) -> bool:
        """Whether the process is ready, starting a new one if the last one exited after it was ready.
        ``wait``: block until it is. Raises WriterProcessError if it died before ready or did not get
        ready within START_TIMEOUT_S of its start. Holds the lock."""
        if self._proc is not None and self._ready and self._proc.poll() is not None:
            log.warning("safepoint: the writer process had exited (%s); starting a new one", self._how())
            self._discard()
        if self._proc is None:
            self._start()
        if self._ready:
            return True
        assert self._sock is not None and self._proc is not None
        deadline = self._started_at + START_TIMEOUT_S
        while not ipc.readable(self._sock, _POLL_S if wait else 0):
            # Died before it was ready (a broken environment, a failing import): not restarted per save.
            if self._proc.poll() is not None:
                raise self._died("while starting", "Its output, if any, is above.")
            if time.monotonic() > deadline:
                self._kill(f"it did not start within {START_TIMEOUT_S:.0f} s")
                raise self._died("while starting", "")
            if not wait:
                return False
        try:
            reply, _ = ipc.recv(self._sock)
        except ipc.ChannelClosed:
            raise self._died("while starting", "Its output, if any, is above.") from None
        self._expect(reply, "ready")
        self._ready = True
        return True

    def _kill(self, why: str) -> None:
        assert self._proc is not None
        self._killed = why
        self._proc.kill()

    def _how(self) -> str:
        assert self._proc is not None
        code = self._proc.poll()
        if self._killed is not None:
            return f"killed by safepoint: {self._killed}"
        if code is None:
            return "still running"
        if code < 0:
            hint = " (the kernel's OOM killer sends SIGKILL)" if code == -signal.SIGKILL else ""
            return f"killed by {_signal_name(code)}{hint}"
        return f"exit code {code}"

    def _died(self, when: str, then: str) -> WriterProcessError:
        assert self._proc is not None
        pid = self._proc.pid
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._kill("its channel broke and it did not exit within 5 s")
            self._proc.wait()
        how = self._how()
        self._discard()
        what = f"the safepoint writer process (pid {pid}) died {when}: {how}."
        return WriterProcessError(f"{what} {then}".strip())

    def _discard(self) -> None:
        if self._sock is not None:
            # shutdown, not only close: a forked process (a DataLoader worker) may hold a copy of this end,
            # and the writer must see the channel end all the same.
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        self._proc, self._sock, self._ready, self._arena_sent, self._held = None, None, False, None, None

    def close(self, timeout_s: float = 10.0) -> None:
        """End the process: it exits when its channel closes (between writes: close waits for one)."""
        with self._lock:
            proc, ready = self._proc, self._ready
            self._discard()
        if proc is None:
            return
        if not ready:
            # Never used (a short run, or closed before its first save): it may still be importing torch,
            # and only reads the channel after that. It holds nothing: stop it now.
            proc.kill()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("safepoint: the writer process (pid %d) did not exit; killing it", proc.pid)
            proc.kill()
            proc.wait()


def _current_nice() -> int:
    try:
        return os.getpriority(os.PRIO_PROCESS, 0)  # the calling thread's, on Linux
    except OSError:
        return 0
