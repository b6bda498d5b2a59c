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
import time
from pathlib import Path
from typing import Any

import torch

from tests.conftest import REPO


def start(
    worker: Path, out: Path, tag: str, jobs: list[dict[str, Any]], *, nproc: int = 2, max_restarts: int = 0
) -> subprocess.Popen[str]:
    """Start ``torchrun`` on ``worker`` with the plan ``jobs``; its output goes to ``out/<tag>.log``.

    The job runs in a session of its own, so :func:`stop` can end torchrun and its workers together."""
    out.mkdir(parents=True, exist_ok=True)
    plan = out / f"{tag}.json"
    plan.write_text(json.dumps({"out": str(out), "jobs": jobs}))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
        str(worker),
        str(plan),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{REPO}")
    # A file, not a pipe: nothing can block on a full pipe. Popen keeps its own descriptor.
    with open(out / f"{tag}.log", "w") as log:
        return subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=REPO, start_new_session=True
        )


def finish(out: Path, tag: str, proc: subprocess.Popen[str], timeout: float = 300) -> tuple[int, str]:
    """Wait for the launch: its exit status and its output."""
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        stop(proc)
    return rc, (out / f"{tag}.log").read_text()


def stop(proc: subprocess.Popen[str]) -> None:
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


def ready_pids(out: Path, job: str, proc: subprocess.Popen[str], timeout: float = 240) -> list[int]:
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
