"""Tensor parallelism (``torch.distributed.tensor.parallel``: ``ColwiseParallel``/``RowwiseParallel`` over a
``DeviceMesh``) saved through safepoint's public API: two real ranks under ``torchrun`` on gloo
(tests/dist/tp_job.py), async saves.

- default: a two-rank run saves; fresh parallelised objects restore it through a new manager bit for bit
  (weights and optimizer state, gathered with ``full_tensor``); the same root restored here, in one
  process, into the plain model (DCP reshards the DTensor shards) gives the same full state; ``safepoint
  verify`` passes;
- slow: the two-rank job killed with kill -9 (the agent's group and both workers) mid-run, restarted: it
  resumes at the newest committed step + 1, every loss of both ranks equals the uninterrupted run's, the
  final state too, and one rank reshards the result.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

import safepoint
from safepoint.cli.main import main as safepoint_cli
from tests.dist.tp_job import build, full_state
from tests.helpers.example_runs import committed_steps, run_forked_rank_job
from tests.helpers.launch import AGENT_IMPORTS
from tests.helpers.rank_jobs import Losses, run_rank_job

JOB = Path(__file__).with_name("tp_job.py")
pytestmark = pytest.mark.timeout(600)


def _kill_job(pid: int, root: Path) -> None:
    for rank in (0, 1):  # torchrun starts its workers in sessions of their own
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
            os.kill(int(Path(f"{root}.pid-{rank}").read_text()), signal.SIGKILL)
    os.killpg(pid, signal.SIGKILL)


def _run(root: Path, *args: str, ranks: int = 2, kill_at: int | None = None) -> tuple[Losses, int, str]:
    """The job under torchrun (``ranks`` > 1), or alone. torchrun's agent and ranks are forked
    (tests/helpers/launch.py ``Agent``: real torchrun, real rank processes and gloo groups)."""
    if ranks == 1:
        cmd = [sys.executable, str(JOB), "--root", str(root), *args]
        return run_rank_job(cmd, root, kill_at=kill_at, kill=lambda proc: _kill_job(proc.pid, root))
    argv = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(JOB)]
    return run_forked_rank_job(
        AGENT_IMPORTS, [*argv, "--root", str(root), *args], root, kill_at=kill_at,
        kill=lambda pid: _kill_job(pid, root), rank_servers=ranks,
    )  # fmt: skip


def _same(a: Path, b: Path | dict[str, torch.Tensor]) -> None:
    sa = torch.load(a, weights_only=True)
    sb = b if isinstance(b, dict) else torch.load(b, weights_only=True)
    assert sa.keys() == sb.keys()
    assert [k for k in sa if not torch.equal(sa[k], sb[k])] == []


def _one_rank(root: Path, step: int) -> dict[str, torch.Tensor]:
    """The checkpoint restored into the plain (not parallelised) model and a fresh optimizer, here."""
    model, opt = build(1, world=1)
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(model=model, optimizer=opt)) == step
    return full_state(model, opt)


def test_two_ranks_restore_bitwise_and_reshard_to_one(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    losses, code, err = _run(root, "--steps", "4", "--save-every", "2", "--out", str(tmp_path / "two.pt"),
                             "--check-restore")  # fmt: skip
    assert code == 0, err[-3000:]
    assert sorted(losses) == [(r, s) for r in (0, 1) for s in range(1, 5)]
    assert committed_steps(root) == [2, 4]
    # Each rank wrote its own shards (the sharded layers are DTensors; DCP writes per-rank files).
    assert len(list((root / "step-4").glob("__*_0.distcp"))) == 2
    _same(tmp_path / "two.pt", _one_rank(root, 4))
    assert safepoint_cli(["verify", str(root), "--all"]) == 0


@pytest.mark.slow  # four torchrun launches (~40 s on the loaded 2-core VM)
def test_two_ranks_kill9_resume_bitwise_then_reshard(tmp_path: Path) -> None:
    steps, kill_at = 8, 5
    args = ("--steps", str(steps), "--save-every", "2")
    ref, code, err = _run(tmp_path / "reference", *args, "--out", str(tmp_path / "ref.pt"))
    assert code == 0, err[-3000:]
    assert sorted(ref) == [(r, s) for r in (0, 1) for s in range(1, steps + 1)]

    root = tmp_path / "ckpt"
    killed, code, err = _run(root, *args, "--step-sleep", "0.3", kill_at=kill_at)
    assert code == -signal.SIGKILL, err[-3000:]
    newest = committed_steps(root)[-1]
    assert 2 <= newest <= kill_at  # a checkpoint taken mid-run, not the end

    resumed, code, err = _run(root, *args, "--out", str(tmp_path / "resumed.pt"))
    assert code == 0, err[-3000:]
    assert sorted(resumed) == [(r, s) for r in (0, 1) for s in range(newest + 1, steps + 1)]
    different = {k: (v, ref[k]) for k, v in (killed | resumed).items() if v != ref[k]}
    assert different == {}, "(rank, step): (loss, uninterrupted loss)"
    _same(tmp_path / "ref.pt", tmp_path / "resumed.pt")

    one, code, err = _run(root, *args, "--out", str(tmp_path / "one.pt"), ranks=1)
    assert (code, one) == (0, {}), err[-3000:]
    _same(tmp_path / "ref.pt", tmp_path / "one.pt")
    assert safepoint_cli(["verify", str(root), "--all"]) == 0
