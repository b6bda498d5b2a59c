"""SafepointCallback on two real Lightning ranks (CPU, gloo; Lightning launches rank 1 itself), killed with
kill -9 of the whole process group and started again (tests/integrations/lightning_ranks_job.py):

- ``ModelParallelStrategy`` (FSDP2 ``fully_shard``): the weights and optimizer state go through safepoint's
  sharded DCP path (each rank writes its shards); the restart resumes at the newest committed step + 1,
  every loss of both ranks equals the uninterrupted run's bit for bit, so do the final gathered weights and
  optimizer state; the same root restored on one rank reshards to the same full state.
- ``FSDPStrategy`` (FSDP1), ``state_dict_type="sharded"`` and ``"full"``: the same checks (both save
  through the sharded DCP path, each rank its shards; restored on one rank). Lightning refuses
  ``FSDPStrategy`` on the CPU only by an exact type check; the job's ``CPUFSDPStrategy`` (an empty subclass)
  and a wrap with ``device_id=cpu`` in ``configure_model`` run Lightning's own strategy on CPU ranks (the
  job says why each is needed). Under ``-m slow`` (the default suite's time bar: the ModelParallel test
  runs the same callback path): the sharded kill -9 and resume against the ModelParallel run's uninterrupted
  reference (FSDP1 and FSDP2 train this model to the same losses and state, bit for bit), and both kinds
  against FSDP's own reference, with the one-rank restore.
  tests/integrations/gpu_lightning_fsdp.py is the same check on a GPU (Lightning's own wrap, NCCL).
- ``DDPStrategy``: the same kill -9 and bitwise resume on two ranks (slow).

Rank 0 of each run is forked from the fork server with the job's imports preloaded
(tests/helpers/example_runs.py ``run_forked_rank_job``: its own session, the interpreter's own exit); rank 1
is started by Lightning's own launcher (its ``Popen([python, SCRIPT, ...])``, its environment, its observer),
the process forked from a rank server of rank 0 (tests/helpers/rank_servers.py ``fork_lightning_ranks``: rank
0's session and process group, so the kill -9 of the group ends it too, or the test would hang on its pipe).
This saves the ~6-8 s of CPU that importing torch and Lightning cost each rank: the default test's four runs
took 45 s of CPU with a fresh rank 1 and 26 s forked.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from safepoint.cli.main import main as safepoint_cli
from tests.helpers.example_runs import committed_steps, preload, run_forked_rank_job
from tests.helpers.rank_jobs import Losses

JOB = Path(__file__).with_name("lightning_ranks_job.py")
STEPS, KILL_AT = 8, 5  # 6 batches an epoch on 2 ranks: the resume crosses the epoch boundary
pytestmark = pytest.mark.timeout(600)


def _run(
    root: Path, strategy: str, *, devices: int = 2, out: Path | None = None, kill_at: int | None = None
) -> tuple[Losses, int, str]:
    """Run the job; with ``kill_at``, kill -9 its process group once rank 0 printed that step. Returns
    ``{(rank, step): loss}``, the exit code and stderr."""
    args = ["--root", str(root), "--strategy", strategy]
    args += ["--devices", str(devices), "--steps", str(STEPS), "--save-every", "2"]
    args += ["--out", str(out)] if out else []
    args += ["--step-sleep", "0.2"] if kill_at else []
    # kill -9 of the group: Lightning's ranks share it
    return run_forked_rank_job(
        preload(str(JOB)), [str(JOB), *args], root, kill_at=kill_at, lightning_ranks=devices - 1
    )


def _equal(a: object, b: object) -> bool:
    """Bit for bit, dict keys in any order (FSDP1 lists the optimizer state in another order than FSDP2)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _same_state(a: Path, b: Path) -> None:
    """The two runs' gathered weights and optimizer state are equal, bit for bit."""
    assert _equal(torch.load(a, weights_only=True), torch.load(b, weights_only=True))


Reference = tuple[Losses, Path]  # the uninterrupted run's losses and its gathered final state


def _reference(tmp: Path, strategy: str) -> Reference:
    ref, code, err = _run(tmp / "reference", strategy, out=tmp / "ref.pt")
    assert code == 0, err[-3000:]
    assert sorted(ref) == [(r, s) for r in (0, 1) for s in range(1, STEPS + 1)]
    return ref, tmp / "ref.pt"


@pytest.fixture(scope="module")
def mp_reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The uninterrupted ModelParallelStrategy run, shared by the default FSDPStrategy case: FSDP1 trains
    this model to the same losses and final state, bit for bit (the slow tests check FSDP against its own
    uninterrupted run)."""
    return _reference(tmp_path_factory.mktemp("mp"), "mp")


def _kill_and_resume(tmp_path: Path, strategy: str, reference: Reference | None = None) -> Path:
    ref, ref_state = reference or _reference(tmp_path, strategy)
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
    _same_state(ref_state, tmp_path / "resumed.pt")
    assert safepoint_cli(["verify", str(root), "--all"]) == 0
    if strategy != "ddp":
        # Each rank wrote its own shards of the weights and optimizer state: DCP's per-rank data files of the
        # final step (safepoint's sharded path; Lightning's CheckpointIO would write one file from rank 0).
        assert len(list((root / f"step-{STEPS}").glob("__*_0.distcp"))) == 2
    return root


def _reshards_to_one_rank(tmp_path: Path, root: Path, strategy: str, ref_state: Path) -> None:
    """The same checkpoint on one rank: DCP reshards; the gathered state is the two-rank run's."""
    losses, code, err = _run(root, strategy, devices=1, out=tmp_path / "one.pt")
    assert (code, losses) == (0, {}), err[-3000:]  # restored at the last step: nothing left to train
    _same_state(ref_state, tmp_path / "one.pt")


def test_model_parallel_kill9_resumes_bitwise_and_reshards_to_one_rank(
    tmp_path: Path, mp_reference: Reference
) -> None:
    root = _kill_and_resume(tmp_path, "mp", mp_reference)
    _reshards_to_one_rank(tmp_path, root, "mp", mp_reference[1])


@pytest.mark.slow  # time bar of the default suite: the ModelParallel (FSDP2) test above is the same callback path
def test_fsdp_sharded_kill9_resumes_bitwise(tmp_path: Path, mp_reference: Reference) -> None:
    """Lightning's FSDPStrategy (FSDP1, state_dict_type="sharded") on CPU ranks (the job's CPUFSDPStrategy
    says how), against the ModelParallel run's losses and state."""
    _kill_and_resume(tmp_path, "fsdp-sharded", mp_reference)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_fsdp_kill9_resumes_bitwise_and_reshards_to_one_rank(tmp_path: Path, kind: str) -> None:
    """Against FSDP's own uninterrupted run; ``full`` still saves sharded (the callback's DCP path)."""
    reference = _reference(tmp_path, f"fsdp-{kind}")
    root = _kill_and_resume(tmp_path, f"fsdp-{kind}", reference)
    _reshards_to_one_rank(tmp_path, root, f"fsdp-{kind}", reference[1])


# Time bar of the default suite: the ModelParallel test above runs the same callback on 2 ranks through kill -9,
# and tests/integrations/test_lightning_example.py the DDP strategy's weight path.
@pytest.mark.slow
def test_ddp_two_ranks_kill9_resumes_bitwise(tmp_path: Path) -> None:
    _kill_and_resume(tmp_path, "ddp")
