"""The processes of ``safepoint demo``: its torchrun launches, their death signals, and their cleanup.

A Launch starts one torchrun (in a session of its own) and reads the events its workers write; stopping it
SIGKILLs torchrun and every process under it, found by walking /proc. die_with_parent (PR_SET_PDEATHSIG,
Linux) makes torchrun and each worker die with the process that started it, so nothing outlives a demo
killed without a chance to clean up. A SIGTERM or SIGHUP to the demo becomes Signalled, which unwinds
through Launch.wait and stops the launch in progress.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safepoint.demo.launch import LaunchResult

_LAUNCH_TIMEOUT_S = 300.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Looked up here, not between fork and exec (preexec_fn), where loading a library is not safe.
_prctl: Any = getattr(ctypes.CDLL(None), "prctl", None) if sys.platform.startswith("linux") else None


def die_with_parent(sig: int, parent_ok: Callable[[int], bool]) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux; a no-op elsewhere).

    ``parent_ok(os.getppid())`` then tells whether the parent is still the expected one: if it died before
    this call, this process is an orphan already and takes ``sig`` at once. Used in torchrun (between fork
    and exec) and in every worker (demo_worker.main).
    """
    if _prctl is None:
        return
    ul = ctypes.c_ulong
    if _prctl(ctypes.c_int(_PR_SET_PDEATHSIG), ul(sig), ul(0), ul(0), ul(0)) == 0 and not parent_ok(
        os.getppid()
    ):
        os.kill(os.getpid(), sig)


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (Linux /proc), None if unknown."""
    try:
        # "pid (comm) state ppid ...": comm may hold spaces, so split after its closing parenthesis.
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


class Launch:
    """One torchrun launch of safepoint.demo.worker; its events are the workers' JSON lines."""

    def __init__(
        self, out: Path, name: str, world: int, jobs: list[dict[str, Any]], max_restarts: int = 0
    ) -> None:
        self.name, self.world = name, world
        self.prefix = out / "logs" / name
        plan = out / "logs" / f"{name}.plan.json"
        jobs = [{**j, "done": f"{self.prefix}.{j['name']}"} for j in jobs]
        plan.write_text(json.dumps({"log": str(self.prefix), "jobs": jobs}, indent=1))
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world}",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.1",
            "-m",
            "safepoint.demo.worker",
            str(plan),
        ]
        # Every worker checks that its torchrun is still this demo's child (demo_worker.main).
        env = dict(os.environ, OMP_NUM_THREADS="1", SAFEPOINT_DEMO_PID=str(os.getpid()))
        self.log_path = out / "logs" / f"{name}.torchrun.log"
        self.t_start = time.time()
        demo = os.getpid()
        with open(self.log_path, "w") as log:  # a file, not a pipe: nothing blocks on a full pipe
            # Its own session: Ctrl-C in the terminal reaches the demo only, which then stops the launch.
            # If the demo dies without stopping it (SIGKILL, a crash), the kernel SIGKILLs torchrun, and
            # each worker's own death signal then takes it (SIGKILL: torchrun would give SIGTERMed workers
            # 30 s, and a rank waiting for the injector's SIGKILL does not act on a SIGTERM).
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=lambda: die_with_parent(signal.SIGKILL, lambda ppid: ppid == demo),
            )
        self._offsets: dict[Path, int] = {}
        self.events: list[dict[str, Any]] = []
        self.rc: int | None = None
        self.t_end = 0.0

    def poll_events(self) -> list[dict[str, Any]]:
        """Events written since the last call (complete lines only)."""
        new: list[dict[str, Any]] = []
        for rank in range(self.world):
            path = Path(f"{self.prefix}.rank{rank}.jsonl")
            if not path.exists():
                continue
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offsets[path] = self._offsets.get(path, 0) + end
            new += [{**json.loads(line), "launch": self.name} for line in data[:end].splitlines() if line]
        self.events += new
        return new

    def wait(self, on_event: Callable[[dict[str, Any] | None], None] | None = None) -> int:
        """Wait for the launch to end; ``on_event`` sees every event, and None about every 20 ms."""
        deadline = time.monotonic() + _LAUNCH_TIMEOUT_S
        try:
            while self.proc.poll() is None:
                for ev in [*self.poll_events(), None]:
                    if on_event:
                        on_event(ev)
                if time.monotonic() > deadline:
                    raise SystemExit(f"demo: launch {self.name} did not finish in {_LAUNCH_TIMEOUT_S:.0f}s")
                time.sleep(0.02)
        finally:
            if self.proc.poll() is None:  # a timeout or Ctrl-C
                self._stop()
        for ev in self.poll_events():
            if on_event:
                on_event(ev)
        self.events.sort(key=lambda e: e["t"])
        self.rc, self.t_end = self.proc.returncode, time.time()
        return self.rc

    def _stop(self) -> None:
        """SIGKILL torchrun and every live process under it.

        torchrun starts each worker in a session of its own, so killing torchrun's group would leave them
        running. They are found by walking /proc down from torchrun while it is stopped: a pid in that
        tree is a live process (or a zombie no one can reap meanwhile), never a reused pid of a worker
        that died long ago. Elsewhere than Linux the workers' own death signal is all there is.
        """
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGSTOP)  # no new workers, no reaping, until it is killed
        for pid in reversed(descendants(self.proc.pid)):  # the deepest first
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def result(self, label: str, role: str, job: str) -> LaunchResult:
        """One job's part of this launch (a launch can run two jobs one after the other)."""
        assert self.rc is not None
        events = [e for e in self.events if e["job"] == job]
        before = [e["t"] for e in self.events if e["job"] != job and e["event"] == "finished"]
        t_start = max([t for t in before if t < events[0]["t"]], default=self.t_start) if events else 0.0
        t_end = max((e["t"] for e in events if e["event"] == "finished"), default=self.t_end)
        return LaunchResult(label, role, self.world, self.rc, t_start, t_end, events)


def descendants(root: int) -> list[int]:
    """The live processes under ``root`` now (Linux /proc; empty elsewhere), parents before children."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # "pid (comm) state ppid ...": comm may hold spaces, so split after its closing parenthesis.
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z":  # a zombie is dead already
                children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(0), [])
        found += kids
        todo += kids
    return found


class Signalled(BaseException):
    """A SIGTERM or SIGHUP to the demo: unwinds through Launch.wait, which stops the launch in progress."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def exit_on(signum: int, frame: Any) -> None:
    """The demo's SIGTERM and SIGHUP handler (demo.main): raises Signalled."""
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a second one must not cut the cleanup short
        signal.signal(sig, signal.SIG_IGN)
    raise Signalled(signum)
