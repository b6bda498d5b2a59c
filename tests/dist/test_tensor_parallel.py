"""Tensor parallelism (``torch.distributed.tensor.parallel``: ``ColwiseParallel``/``RowwiseParallel`` over a
``DeviceMesh``) saved through safepoint's public API: two real ranks under ``torchrun`` on gloo
(tests/dist/tp_job.py), async saves.

- default: a two-rank run saves; fresh parallelised objects restore it through a new manager bit for bit
  (weights and optimizer state, gathered with ``full_tensor``); the same root restored here, in one
  process, into the plain model (DCP reshards the DTensor shards) gives the same full state; ``safepoint
  verify`` passes;
- slow: the two-rank job killed with kill -9 (the agent's group and both workers) mid-run, restarted: it
  resumes at the newest committed step + 1, every loss of both ranks equals the uninterrupted run's, the
  final state too, and one rank reshards the result;
- slow: another tensor-parallel degree (2 -> 3 ranks, a width neither divides: uneven DTensor shards)
  restores the two-rank checkpoint bit for bit, trains on and saves, and one plain rank restores that;
- slow: torchtitan's usual layout, a 2-D ``("dp", "tp")`` mesh of 4 ranks (tensor parallelism over "tp",
  FSDP2 ``fully_shard`` over "dp"), killed with kill -9 mid-run and resumed bit for bit; its root restores
  into 2 ranks of tensor parallelism alone and into the plain model on one rank, bit for bit.
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


def _kill_job(pid: int, root: Path, ranks: int = 2) -> None:
    for rank in range(ranks):  # torchrun starts its workers in sessions of their own
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
        kill=lambda pid: _kill_job(pid, root, ranks), rank_servers=ranks,
    )  # fmt: skip


def _same(a: Path, b: Path | dict[str, torch.Tensor]) -> None:
    sa = torch.load(a, weights_only=True)
    sb = b if isinstance(b, dict) else torch.load(b, weights_only=True)
    assert sa.keys() == sb.keys()
    assert [k for k in sa if not torch.equal(sa[k], sb[k])] == []


def _one_rank(root: Path, step: int, hidden: int = 64) -> dict[str, torch.Tensor]:
    """The checkpoint restored into the plain (not parallelised) model and a fresh optimizer, here."""
    model, opt = build(1, world=1, hidden=hidden)
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


@pytest.mark.slow  # a two-rank and a three-rank torchrun launch
def test_restore_into_another_tp_degree_uneven_then_one_rank(tmp_path: Path) -> None:
    # hidden 25: 2 ranks hold 13 + 12 of it, 3 ranks 9 + 8 + 8 (DTensor's uneven shards, torch.chunk's split)
    root, size = tmp_path / "ckpt", ("--hidden", "25", "--save-every", "2")
    two, code, err = _run(root, *size, "--steps", "4", "--out", str(tmp_path / "two.pt"))
    assert code == 0, err[-3000:]
    assert sorted(two) == [(r, s) for r in (0, 1) for s in range(1, 5)]
    assert committed_steps(root) == [2, 4]

    # --expect: each of the 3 ranks restores into fresh parallelised objects through a new manager and
    # compares the full weights and optimizer state (full_tensor) with the two-rank run's, exit 3 if not equal.
    three, code, err = _run(root, *size, "--steps", "7", "--expect", str(tmp_path / "two.pt"),
                            "--out", str(tmp_path / "three.pt"), ranks=3)  # fmt: skip
    assert code == 0, err[-3000:]
    assert sorted(three) == [(r, s) for r in (0, 1, 2) for s in range(5, 8)]
    assert all(three[(r, s)] == three[(0, s)] for r, s in three)  # tensor parallelism: one loss per step
    assert committed_steps(root) == [2, 4, 6, 7]
    assert len(list((root / "step-7").glob("__*_0.distcp"))) == 3
    _same(tmp_path / "three.pt", _one_rank(root, 7, hidden=25))
    assert safepoint_cli(["verify", str(root), "--all"]) == 0


@pytest.mark.slow  # three four-rank torchrun launches and a two-rank one
def test_fsdp2_and_tp_on_a_2d_mesh_kill9_resume_then_other_layouts(tmp_path: Path) -> None:
    steps, kill_at = 8, 5
    args = ("--dp", "2", "--steps", str(steps), "--save-every", "2")
    ref, code, err = _run(tmp_path / "reference", *args, "--out", str(tmp_path / "ref.pt"), ranks=4)
    assert code == 0, err[-3000:]
    assert sorted(ref) == [(r, s) for r in range(4) for s in range(1, steps + 1)]
    # ranks 0, 1 (dp 0) and 2, 3 (dp 1) train on different slices of each batch
    assert ref[(0, 1)] == ref[(1, 1)] != ref[(2, 1)] == ref[(3, 1)]

    root = tmp_path / "ckpt"
    killed, code, err = _run(root, *args, "--step-sleep", "0.3", kill_at=kill_at, ranks=4)
    assert code == -signal.SIGKILL, err[-3000:]
    newest = committed_steps(root)[-1]
    assert 2 <= newest <= kill_at  # a checkpoint taken mid-run, not the end
    assert len(list((root / f"step-{newest}").glob("__*_0.distcp"))) == 4

    resumed, code, err = _run(root, *args, "--out", str(tmp_path / "resumed.pt"), ranks=4)
    assert code == 0, err[-3000:]
    assert sorted(resumed) == [(r, s) for r in range(4) for s in range(newest + 1, steps + 1)]
    different = {k: (v, ref[k]) for k, v in (killed | resumed).items() if v != ref[k]}
    assert different == {}, "(rank, step): (loss, uninterrupted loss)"
    _same(tmp_path / "ref.pt", tmp_path / "resumed.pt")

    # Another layout: 2 ranks of tensor parallelism alone, fresh objects, compared on every rank (--expect).
    tp_only, code, err = _run(
        root, "--steps", str(steps), "--save-every", "2", "--expect", str(tmp_path / "ref.pt")
    )
    assert (code, tp_only) == (0, {}), err[-3000:]
    _same(tmp_path / "ref.pt", _one_rank(root, steps))
    assert safepoint_cli(["verify", str(root), "--all"]) == 0
