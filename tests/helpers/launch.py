"""The test side of the torchrun plan workers: launching a plan, reading what the ranks logged, comparing
the state dicts they dumped. Used by tests/dist/test_distributed.py, tests/preempt/test_preemption.py and
tests/preempt/test_preemption_tiered.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tests.conftest import REPO
from tests.helpers import forkserver

# The torchrun agent, forked from a fork server that imported it once (tests/helpers/forkserver.py): each
# agent otherwise pays ~2.6 s of CPU only to import torch. Its ranks are forked too, from rank servers the
# agent forks before torchrun starts (forkserver.py ``_fork_ranks``): a rank otherwise pays ~4.5 s of CPU to
# import torch, DCP and safepoint. torchrun stays real (rendezvous, monitoring, restarts, the signals it
# sends), and so do the ranks: session leaders, real gloo process groups, real signals.
# Its imports, not ``torch.distributed.run`` itself: ``runpy`` runs that module fresh, as ``python -m`` does
# (one already imported would make runpy warn on the agent's stderr).
AGENT_IMPORTS = (
    "import torch.distributed.launcher.api",
    "import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    "import torch.distributed.elastic.rendezvous.dynamic_rendezvous",
    "import torch.distributed.elastic.rendezvous.static_tcp_rendezvous",
    # What the ranks import (the agent never uses them): numpy, torch.optim's lazy torch._dynamo (~1.6 s at
    # a rank's first optimizer), DCP and safepoint.
    "import numpy",
    "import torch._dynamo",
    "import torch.distributed.checkpoint",
    "import safepoint",
)
# What only the ranks read (never the agent's imports): jobs differing only in these share a fork server.
# OMP_NUM_THREADS: the agent computes nothing; its server imports torch with one OpenMP thread (a fork needs
# a single-threaded server) and the ranks, fresh interpreters, read the job's own setting.
AGENT_PER_RUN = (
    "NODE_LOCAL_ROOT",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
)


def _nproc(args: list[str]) -> int:
    """torchrun's ``--nproc-per-node`` (its default 1); 0 (no forked ranks) for a value it computes."""
    for i, arg in enumerate(args):
        for flag in ("--nproc-per-node", "--nproc_per_node"):
            if arg == flag:
                arg = f"{flag}={args[i + 1]}"
            if arg.startswith(f"{flag}="):
                value = arg.split("=", 1)[1]
                return int(value) if value.isdigit() else 0
    return 1


class Agent:
    """A torchrun agent (``python -m torch.distributed.run ARGS``) forked from the fork server; what the tests
    use of ``subprocess.Popen``: ``pid`` (it leads its own session), ``poll``, ``wait``, ``returncode``."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str],
        stdout: int,
        stderr: int,
        cwd: Path,
        hostname: str | None = None,
    ) -> None:
        self.args = [sys.executable, "-m", "torch.distributed.run", *args]
        self._child = forkserver.spawn(
            AGENT_IMPORTS, ["-m", "torch.distributed.run", *args], env, stdout, stderr, str(cwd),
            per_run=AGENT_PER_RUN, hostname=hostname, server_env={"OMP_NUM_THREADS": "1"},
            rank_servers=_nproc(args),
        )  # fmt: skip
        self.pid = self._child.pid

    @property
    def returncode(self) -> int | None:
        return self._child.returncode

    def wait(self, timeout: float | None = None) -> int:
        try:
            return self._child.wait(timeout)
        except TimeoutError:
            raise subprocess.TimeoutExpired(self.args, timeout or 0) from None

    def poll(self) -> int | None:
        return self._child.poll()


def agent(
    args: list[str],
    env: dict[str, str],
    stdout: int,
    stderr: int | None = None,
    cwd: Path = REPO,
    hostname: str | None = None,
) -> Agent:
    """Start ``torchrun ARGS`` (in a session of its own) with these descriptors as its stdout and stderr
    (``stderr=None``: with stdout)."""
    return Agent(args, env, stdout, stdout if stderr is None else stderr, cwd, hostname)


def run_agent(
    args: list[str], env: dict[str, str], timeout: float, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(torchrun ARGS, capture_output=True, text=True, timeout=...)`` with a forked agent; on
    a timeout its whole session is killed and ``subprocess.TimeoutExpired`` raised."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = agent(args, env, out.fileno(), err.fileno(), cwd)
        try:
            code = proc.wait(timeout)
        finally:
            stop(proc)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(proc.args, code, out.read().decode(), err.read().decode())


def start(
    worker: Path, out: Path, tag: str, jobs: list[dict[str, Any]], *, nproc: int = 2, max_restarts: int = 0
) -> Agent:
    """Start ``torchrun`` on ``worker`` with the plan ``jobs``; its output goes to ``out/<tag>.log``.

    The job runs in a session of its own, so :func:`stop` can end torchrun and its workers together."""
    out.mkdir(parents=True, exist_ok=True)
    plan = out / f"{tag}.json"
    plan.write_text(json.dumps({"out": str(out), "jobs": jobs}))
    args = [
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
        str(worker),
        str(plan),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{REPO}")
    # A file, not a pipe: nothing can block on a full pipe. The agent keeps its own descriptor.
    with open(out / f"{tag}.log", "w") as log:
        return agent(args, env, log.fileno())


def finish(out: Path, tag: str, proc: Agent | subprocess.Popen[str], timeout: float = 300) -> tuple[int, str]:
    """Wait for the launch: its exit status and its output."""
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        stop(proc)
    return rc, (out / f"{tag}.log").read_text()


def stop(proc: Agent | subprocess.Popen[str]) -> None:
    """SIGKILL torchrun and whatever of its session is left (a failed test must not leave workers)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def events(out: Path, job: str, event: str, rank: int | None = None) -> list[dict[str, Any]]:
    """The records the ranks logged (tests.helpers.torchrun.Log) for ``job`` and ``event``, rank by rank."""
    found = []
    for path in sorted(out.glob("log.rank*.jsonl")):
        r = int(path.stem.split("rank")[1])
        if rank is not None and r != rank:
            continue
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["job"] == job and rec["event"] == event:
                found.append({**rec, "rank": r})
    return found


def ready_pids(out: Path, job: str, proc: Agent | subprocess.Popen[str], timeout: float = 240) -> list[int]:
    """Wait until both ranks of ``job`` wrote their ready file (their pid): they are training."""
    files = [out / f"{job}.ready.rank{r}" for r in (0, 1)]
    deadline = time.monotonic() + timeout
    while not all(f.exists() and f.read_text() for f in files):
        assert proc.poll() is None, f"torchrun exited before {job} was ready"
        assert time.monotonic() < deadline, f"{job} never became ready"
        time.sleep(0.05)
    return [int(f.read_text()) for f in files]


def load(path: Path) -> dict[str, Any]:
    sd: dict[str, Any] = torch.load(path, weights_only=True)
    return sd


def assert_bitwise(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {a.keys()} vs {b.keys()}"
        for k in a:
            assert_bitwise(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
