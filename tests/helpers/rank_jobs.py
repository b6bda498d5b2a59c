"""Run a multi-rank framework job that prints ``rank R step N loss L`` and kill it mid-run (kill -9).

Shared by tests/integrations/test_lightning_ranks.py and test_accelerate_ranks.py: the job's stdout is read
line by line, and once rank 0 printed step ``kill_at``, ``kill(proc)`` kills the whole job (the caller knows
which processes make it up).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tests.conftest import REPO, SUBPROCESS_ENV

LINE = re.compile(r"rank (\d+) step (\d+) loss (\S+)\Z")
Losses = dict[tuple[int, int], str]


def killpg(proc: subprocess.Popen[str]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)


def run_rank_job(
    cmd: list[str],
    root: Path,
    *,
    kill_at: int | None = None,
    kill: Callable[[subprocess.Popen[str]], None] = killpg,
) -> tuple[Losses, int, str]:
    """Run ``cmd`` (a session of its own, one OpenMP thread, no GPU); returns ``{(rank, step): loss}``, the
    exit code and stderr."""
    env = dict(SUBPROCESS_ENV, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    err_path = root.parent / f"{root.name}-{time.monotonic_ns()}.stderr"
    losses: Losses = {}
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=REPO, start_new_session=True
        )
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                m = LINE.match(line.strip())
                if m:
                    rank, step = int(m.group(1)), int(m.group(2))
                    losses[(rank, step)] = m.group(3)
                    if (rank, step) == (0, kill_at):
                        kill(proc)
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                kill(proc)
                proc.wait()
    return losses, proc.returncode, err_path.read_text()
