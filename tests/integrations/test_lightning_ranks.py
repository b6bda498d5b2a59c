"""SafepointCallback on two real Lightning ranks (CPU, gloo; Lightning launches rank 1 itself), killed with
kill -9 of the whole process group and started again (tests/integrations/lightning_ranks_job.py):

- ``ModelParallelStrategy`` (FSDP2 ``fully_shard``): the weights and optimizer state go through safepoint's
  sharded DCP path (each rank writes its shards); the restart resumes at the newest committed step + 1,
  every loss of both ranks equals the uninterrupted run's bit for bit, so do the final gathered weights and
  optimizer state; the same root restored on one rank reshards to the same full state.
- ``DDPStrategy``: the same kill -9 and bitwise resume on two ranks.

Lightning refuses ``FSDPStrategy`` on the CPU (it asks for a GPU, and FSDP1 needs an accelerator): that
strategy is checked by tests/integrations/gpu_lightning_fsdp.py on a GPU machine.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_flatten

from safepoint.cli.main import main as safepoint_cli
from tests.helpers.example_runs import committed_steps
from tests.helpers.rank_jobs import Losses, run_rank_job

JOB = Path(__file__).with_name("lightning_ranks_job.py")
STEPS, KILL_AT = 8, 5  # 6 batches an epoch on 2 ranks: the resume crosses the epoch boundary
pytestmark = pytest.mark.timeout(600)


def _run(
    root: Path, strategy: str, *, devices: int = 2, out: Path | None = None, kill_at: int | None = None
) -> tuple[Losses, int, str]:
    """Run the job; with ``kill_at``, kill -9 its process group once rank 0 printed that step. Returns
    ``{(rank, step): loss}``, the exit code and stderr."""
    cmd = [sys.executable, str(JOB), "--root", str(root), "--strategy", strategy]
    cmd += ["--devices", str(devices), "--steps", str(STEPS), "--save-every", "2"]
    cmd += ["--out", str(out)] if out else []
    cmd += ["--step-sleep", "0.2"] if kill_at else []
    return run_rank_job(cmd, root, kill_at=kill_at)  # kill -9 of the group: Lightning's ranks share it


def _same_state(a: Path, b: Path) -> None:
    """The two runs' gathered weights and optimizer state are equal, bit for bit."""
    (fa, spec_a), (fb, spec_b) = (tree_flatten(torch.load(p, weights_only=True)) for p in (a, b))
    assert spec_a == spec_b
    for x, y in zip(fa, fb, strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def _kill_and_resume(tmp_path: Path, strategy: str) -> Path:
    ref, code, err = _run(tmp_path / "reference", strategy, out=tmp_path / "ref.pt")
    assert code == 0, err[-3000:]
    assert sorted(ref) == [(r, s) for r in (0, 1) for s in range(1, STEPS + 1)]

    root = tmp_path / "ckpt"
    killed, code, err = _run(root, strategy, kill_at=KILL_AT)
    assert code == -signal.SIGKILL, err[-3000:]
    newest = committed_steps(root)[-1]
    assert 2 <= newest <= KILL_AT  # a checkpoint taken mid-run, not the end

    resumed, code, err = _run(root, strategy, out=tmp_path / "resumed.pt")
    assert code == 0, err[-3000:]
    assert sorted(resumed) == [(r, s) for r in (0, 1) for s in range(newest + 1, STEPS + 1)]
    different = {k: (v, ref[k]) for k, v in (killed | resumed).items() if v != ref[k]}
    assert different == {}, "(rank, step): (loss, uninterrupted loss)"
    _same_state(tmp_path / "ref.pt", tmp_path / "resumed.pt")
    assert safepoint_cli(["verify", str(root), "--all"]) == 0
    return root


def test_model_parallel_kill9_resumes_bitwise_and_reshards_to_one_rank(tmp_path: Path) -> None:
    root = _kill_and_resume(tmp_path, "mp")
    # Each rank wrote its own shards of the weights (DCP's per-rank data files of the final step).
    assert len(list((root / f"step-{STEPS}").glob("__*_0.distcp"))) == 2
    # The same checkpoint on one rank: DCP reshards; the gathered state is the two-rank run's.
    losses, code, err = _run(root, "mp", devices=1, out=tmp_path / "one.pt")
    assert (code, losses) == (0, {}), err[-3000:]  # restored at the last step: nothing left to train
    _same_state(tmp_path / "ref.pt", tmp_path / "one.pt")


# Time bar of the default suite: the ModelParallel test above runs the same callback on 2 ranks through kill -9,
# and tests/integrations/test_lightning_example.py the DDP strategy's weight path.
@pytest.mark.slow
def test_ddp_two_ranks_kill9_resumes_bitwise(tmp_path: Path) -> None:
    _kill_and_resume(tmp_path, "ddp")
