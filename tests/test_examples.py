"""Every example runs as documented, and resumes when run again.

The distributed examples run under real torchrun with 2 ranks (gloo on CPU) and resume at another world
size; the same runs with NCCL are skipped without 2 GPUs. The Slurm and Kubernetes files and
preemptible_train.py are run by tests/preempt/test_preemption.py.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch

import safepoint
from tests.conftest import REPO
from tests.helpers.example_runs import run_job
from tests.helpers.launch import run_agent

EXAMPLES = REPO / "examples"
BATCH = 16  # per rank, as in ddp.py and fsdp2.py
GPU_ONLY = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL run: needs 2 GPUs (one per rank)")
# Runs an example with every rank but 0 seeing the checkpoint root as a lagging NFS client can: without the
# newest checkpoint. An example must not decide on entering a collective save from its own listing.
LAGGING_LISTING = """
import os, runpy, sys
import safepoint

if int(os.environ["RANK"]) > 0:
    listing = safepoint.CheckpointManager.list
    safepoint.CheckpointManager.list = lambda self: listing(self)[:-1]
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_quickstart_runs_and_resumes(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    cmd = [str(EXAMPLES / "quickstart.py"), str(root)]
    # ``python quickstart.py ROOT``, forked from the fork server that imported torch and safepoint once
    # (tests/helpers/forkserver.py: its own session, fresh signal dispositions, the interpreter's exit): the
    # suite's server for its own jobs, in their environment, so no server of its own (~4-5 s of CPU).
    first = run_job(cmd, timeout=240)
    assert first.returncode == 0, first.stderr[-4000:]
    assert "finished at step 200, tokens_seen=1600" in first.stdout
    assert sorted(p.name for p in root.glob("step-*")) == ["step-100", "step-150", "step-200"]
    # A second run resumes at 200 and has nothing left to do; the counters come back with it.
    again = run_job(cmd, timeout=240)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "finished at step 200, tokens_seen=1600" in again.stdout


def torchrun(example: str, nproc: int, root: Path, steps: int, device: str, lagging: bool = False) -> str:
    script = [str(EXAMPLES / example)]
    if lagging:
        wrapper = root.parent / "lagging_listing.py"
        wrapper.write_text(LAGGING_LISTING)
        script.insert(0, str(wrapper))
    cmd = [
        *("--standalone", f"--nproc-per-node={nproc}"),
        *(*script, str(root), "--steps", str(steps), "--save-every", "3"),
    ]
    # The PYTHONPATH of the suite's other agents (tests/helpers/launch.py ``start``): any other keys a fork
    # server of its own (~5 s of CPU to import torch, DCP and safepoint once more).
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{REPO}")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the examples pick NCCL whenever they see a GPU
    # The agent forked from a fork server (tests/helpers/launch.py); the example's ranks are fresh processes.
    proc = run_agent(cmd, env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU_ONLY)])
@pytest.mark.parametrize(
    ("example", "resume_nproc"), [pytest.param("ddp.py", 1, marks=pytest.mark.slow), ("fsdp2.py", 3)]
)
def test_distributed_example_resumes_at_another_world_size(
    example: str, resume_nproc: int, device: str, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    # Step 6 is a periodic save; rank 1 does not see it in the listing, and must not save it again alone.
    out = torchrun(example, 2, root, steps=6, device=device, lagging=True)
    assert out.splitlines() == ["resumed at step 0 with 2 ranks", "finished at step 6"]
    out = torchrun(example, resume_nproc, root, steps=9, device=device)
    assert out.splitlines() == [f"resumed at step 6 with {resume_nproc} ranks", "finished at step 9"]

    # The data position went on at the new world size: every sample drawn once, none skipped.
    sampler = safepoint.ResumableSampler(4096, seed=0, rank=0, world_size=1)
    with safepoint.CheckpointManager(root) as mgr:
        assert [(c.step, c.world_size) for c in mgr.list()] == [(6, 2), (9, resume_nproc)]
        assert mgr.restore(safepoint.TrainState(dataloader=sampler, rng=False)) == 9
    assert sampler.state_dict()["position"] == BATCH * (6 * 2 + 3 * resume_nproc)


def test_every_example_is_listed_and_run() -> None:
    readme = (EXAMPLES / "README.md").read_text()
    tests = "".join(p.read_text() for p in (REPO / "tests").rglob("test_*.py"))
    for path in sorted(EXAMPLES.rglob("*")):
        if path.is_file() and path.name != "README.md" and "__pycache__" not in path.parts:
            rel = path.relative_to(EXAMPLES).as_posix()
            assert f"]({rel})" in readme, f"examples/README.md does not list {rel}"
            assert path.name in tests, f"no test runs examples/{rel}"


def test_examples_pass_metrics_as_tensors() -> None:
    """loss.item() in a training loop waits for the GPU every step; a tensor is read only when saving."""
    for path in sorted(EXAMPLES.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "metrics" and isinstance(node.value, ast.Dict):
                for value in node.value.values:
                    call = value.func if isinstance(value, ast.Call) else None
                    assert not (isinstance(call, ast.Attribute) and call.attr == "item"), (
                        f"{path.name}:{value.lineno}: pass the tensor (loss.detach()), not .item()"
                    )
