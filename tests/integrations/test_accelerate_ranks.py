"""``accelerate launch`` with two processes (CPU, gloo; tests/integrations/accelerate_ranks_job.py): kill -9
of the whole job (the launcher's group and both workers, which torchrun starts in sessions of their own)
mid-epoch, then a restart. The restart begins at the newest committed step + 1, and every loss of both
processes equals the uninterrupted run's, bit for bit, across the epoch boundary after the resume (the
next epoch's shuffle is drawn from Accelerate's synchronised generator, which the replay leaves where the
interrupted run had it). ``safepoint verify --all`` passes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from safepoint.cli.main import main as safepoint_cli
from tests.conftest import REPO, SUBPROCESS_ENV
from tests.helpers.example_runs import committed_steps

JOB = Path(__file__).with_name("accelerate_ranks_job.py")
LINE = re.compile(r"rank (\d+) step (\d+) loss (\S+)\Z")
STEPS, KILL_AT = 8, 5  # 6 batches per process and epoch: the restart crosses the epoch boundary
pytestmark = pytest.mark.timeout(600)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill_job(proc: subprocess.Popen[str], root: Path) -> None:
    for rank in (0, 1):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
            os.kill(int(Path(f"{root}.pid-{rank}").read_text()), signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)


def _run(root: Path, kill_at: int | None = None) -> tuple[dict[tuple[int, int], str], int, str]:
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", str(_free_port())]
    cmd = [*launch, str(JOB), "--root", str(root), "--steps", str(STEPS), "--save-every", "2"]
    cmd += ["--step-sleep", "0.2"] if kill_at else []
    env = dict(SUBPROCESS_ENV, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    err_path = root.parent / f"{root.name}-{time.monotonic_ns()}.stderr"
    losses: dict[tuple[int, int], str] = {}
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
                        _kill_job(proc, root)
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                _kill_job(proc, root)
                proc.wait()
    return losses, proc.returncode, err_path.read_text()


def test_two_processes_kill9_resume_bitwise(tmp_path: Path) -> None:
    ref, code, err = _run(tmp_path / "reference")
    assert code == 0, err[-3000:]
    assert sorted(ref) == [(r, s) for r in (0, 1) for s in range(1, STEPS + 1)]

    root = tmp_path / "ckpt"
    killed, code, err = _run(root, kill_at=KILL_AT)
    assert code == -signal.SIGKILL, err[-3000:]
    newest = committed_steps(root)[-1]
    assert 2 <= newest <= KILL_AT

    resumed, code, err = _run(root)
    assert code == 0, err[-3000:]
    assert sorted(resumed) == [(r, s) for r in (0, 1) for s in range(newest + 1, STEPS + 1)]
    different = {k: (v, ref[k]) for k, v in (killed | resumed).items() if v != ref[k]}
    assert different == {}, "(rank, step): (loss, uninterrupted loss)"
    assert safepoint_cli(["verify", str(root), "--all"]) == 0
