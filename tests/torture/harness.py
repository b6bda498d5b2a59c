"""Parent side: drive the zygote, with a timeout on every child (a hang is a failure, not a stuck suite)."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent.parent
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{REPO}")


class ChildHung(AssertionError):
    pass


class Zygote:
    def __init__(self, log: Path) -> None:
        self.log = log
        self._err = open(log, "ab")  # noqa: SIM115 - lives as long as the zygote
        # ``python -m tests.torture.zygote`` with pipes to its stdin and stdout, forked from the suite's fork
        # server (tests/helpers/example_runs.py ``PipedJob``: torch and safepoint imported once, ~4 s of CPU
        # less per pytest process; the zygote still warms up and forks its children itself).
        from tests.helpers.example_runs import PipedJob  # the test side only: the zygote imports this module

        self.proc = PipedJob(["-m", "tests.torture.zygote"], stderr=self._err.fileno(), text=False)
        self._buf = b""
        self._queue: list[dict[str, Any]] = []
        self._decoder = json.JSONDecoder()
        self.pid: int | None = None
        self.running = False

    def _readline(self, deadline: float) -> dict[str, Any] | None:
        """The next JSON message, None at the deadline."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while not self._queue:
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                ready, _, _ = select.select([fd], [], [], left)
                if ready:
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        raise AssertionError(f"the zygote died; its log:\n{self.log_tail()}")
                    self._buf += chunk
            line, self._buf = self._buf.split(b"\n", 1)
            # Defensive: should a killed child ever leave a line without its newline, the objects glued
            # together are still read one by one.
            text, pos = line.decode(), 0
            while pos < len(text):
                obj, pos = self._decoder.raw_decode(text, pos)
                self._queue.append(obj)
        out: dict[str, Any] = self._queue.pop(0)
        return out

    def start(self, cmd: dict[str, Any], timeout: float = 60.0) -> int:
        assert self.proc.stdin is not None
        if self.running:  # a previous caller failed between start() and wait(): end that child first
            assert self.pid is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(ChildHung):
                self.wait(60)
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        msg = self._readline(time.monotonic() + timeout)
        assert msg is not None and "pid" in msg, msg
        self.pid = int(msg["pid"])
        self.running = True
        return self.pid

    def messages(self, timeout: float) -> Iterator[dict[str, Any]]:
        """The child's JSON lines, then its {"status": ...}; kills the child (ChildHung) past ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self._readline(deadline)
            if msg is None:
                assert self.pid is not None
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                end = time.monotonic() + 30
                while msg is None or "status" not in msg:
                    msg = self._readline(end)
                    if msg is None and time.monotonic() >= end:
                        break
                self.running = False
                raise ChildHung(f"child {self.pid} hung for {timeout}s and was killed")
            if "status" in msg:
                self.running = False
            yield msg
            if "status" in msg:
                return

    def wait(self, timeout: float = 120.0) -> int:
        """The child's exit code (negative: killed by that signal)."""
        status = None
        for msg in self.messages(timeout):
            status = msg.get("status")
        assert status is not None
        return os.waitstatus_to_exitcode(status)

    def run(self, cmd: dict[str, Any], timeout: float = 120.0) -> int:
        self.start(cmd)
        return self.wait(timeout)

    def log_tail(self, n: int = 4000) -> str:
        self._err.flush()
        return self.log.read_bytes()[-n:].decode(errors="replace")

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        finally:
            self.proc.stdout.close()
            self._err.close()

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_shared: Zygote | None = None


def shared_zygote(log_dir: Path) -> Zygote:
    """One zygote for every torture test module in this pytest process (its start costs seconds)."""
    global _shared
    if _shared is None or _shared.proc.poll() is not None:
        _shared = Zygote(log_dir / "zygote.log")
        atexit.register(_shared.close)
    return _shared
