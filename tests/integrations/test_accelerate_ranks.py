"""``accelerate launch`` with two processes (CPU, gloo; tests/integrations/accelerate_ranks_job.py): kill -9
of the whole job (the launcher's group and both workers, which torchrun starts in sessions of their own)
mid-epoch, then a restart. The restart begins at the newest committed step + 1, and every loss of both
processes equals the uninterrupted run's, bit for bit, across the epoch boundary after the resume (the
next epoch's shuffle is drawn from Accelerate's synchronised generator, which the replay leaves where the
interrupted run had it). ``safepoint verify --all`` passes."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

import pytest

from safepoint.cli.main import main as safepoint_cli
from tests.helpers.example_runs import committed_steps, preload, run_forked_rank_job
from tests.helpers.launch import AGENT_IMPORTS
from tests.helpers.rank_jobs import Losses, run_rank_job
from tests.helpers.s3 import free_port

JOB = Path(__file__).with_name("accelerate_ranks_job.py")
STEPS, KILL_AT = 8, 5  # 6 batches per process and epoch: the restart crosses the epoch boundary
pytestmark = pytest.mark.timeout(600)


def _kill_job(pid: int, root: Path) -> None:
    for rank in (0, 1):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
            os.kill(int(Path(f"{root}.pid-{rank}").read_text()), signal.SIGKILL)
    os.killpg(pid, signal.SIGKILL)


def _run(root: Path, kill_at: int | None = None, fresh: bool = False) -> tuple[Losses, int, str]:
    """``accelerate launch`` of the job. ``fresh``: as a user runs it (``python -m accelerate.commands.launch``
    and the ranks it starts, fresh interpreters); otherwise the launcher is forked and its torchrun agent forks
    the ranks (tests/helpers/launch.py ``Agent``: real Accelerate launcher and torchrun, real rank
    processes, gloo and signals), ~25 s of CPU less per launch."""
    launch = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", str(free_port())]
    argv = [*launch, str(JOB), "--root", str(root), "--steps", str(STEPS), "--save-every", "2"]
    argv += ["--step-sleep", "0.2"] if kill_at else []
    if fresh:
        cmd = [sys.executable, *argv]
        return run_rank_job(cmd, root, kill_at=kill_at, kill=lambda proc: _kill_job(proc.pid, root))
    imports = (*AGENT_IMPORTS, *preload(str(JOB)))
    return run_forked_rank_job(
        imports, argv, root, kill_at=kill_at, kill=lambda pid: _kill_job(pid, root), rank_servers=2
    )


# -m slow (time bar of the default suite: three 2-process launches); the default suite runs Accelerate in
# tests/integrations/test_framework_examples.py (examples/accelerate_train.py: SIGTERM, kill -9, bitwise) and
# two-rank kill -9 resumes through torchrun (tests/dist/test_distributed.py) and Lightning (test_lightning_ranks).
@pytest.mark.slow
def test_two_processes_kill9_resume_bitwise(tmp_path: Path) -> None:
    # The uninterrupted reference as a user runs it; the killed and resumed runs forked must equal it.
    ref, code, err = _run(tmp_path / "reference", fresh=True)
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
