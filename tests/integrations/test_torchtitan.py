"""safepoint.integrations.torchtitan: torchtitan 0.3's checkpointer contract kept by safepoint.

torchtitan's ``Trainer`` imports triton, which is not installed here: tests/integrations/torchtitan_job.py
runs the trainer's loop on torchtitan's real optimizer, scheduler and dataloader containers, with the
checkpointer built from its ``Config`` as the trainer builds it. Checked:

- SIGTERM to the job's process group (``save_on_sigterm``): it saves the step it printed last and exits 143;
  the restart continues from the next one, every loss the uninterrupted run's;
- kill -9 of the job mid-run: the restart's first step is the newest committed step + 1 and every loss
  equals the uninterrupted run's, bit for bit (dropout on: the RNG comes back too);
- a fresh set of torchtitan objects loads the saved state bit for bit (model, optimizer, scheduler,
  dataloader position, train state);
- (slow) two ranks on gloo with FSDP2, as torchtitan shards data parallelism: a new torchrun resumes bit
  for bit;
- the config is a ``BaseCheckpointManager.Config`` that builds this class; retention follows
  ``keep_latest_k``; ``exclude_from_loading`` leaves that part as it is; unsupported options are refused.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.conftest import REPO
from tests.helpers.example_runs import Run, committed_steps, run_example

JOB = "../tests/integrations/torchtitan_job.py"  # run_example runs examples/<script>
STEPS, SAVE_EVERY = 12, 3


@pytest.fixture(autouse=True, scope="module")
def _needs_torchtitan() -> None:
    # Asked when a test of this module runs, not at its import: every xdist worker imports each test module
    # to collect it, and only the worker that runs these tests should pay for torchtitan.
    pytest.importorskip("torchtitan.components.checkpointer.base")


def _check(run: Run, reference: dict[int, str]) -> None:
    different = [(s, loss, reference[s]) for s, loss in run.losses if loss != reference[s]]
    assert different == [], f"(step, loss, uninterrupted loss): {different[:5]}"


@pytest.mark.slow  # time bar of the default suite: four real runs; torchtitan's interface, save and load run in-process by default
def test_sigterm_then_kill9_resume_bit_for_bit(tmp_path: Path) -> None:
    args = ("--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--save-on-sigterm")
    # fresh=True: each run a new interpreter (-m slow, so not moved to tests/helpers/forkserver.py)
    ref = run_example(JOB, tmp_path / "reference", *args, fresh=True)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert [s for s, _ in ref.losses] == list(range(1, STEPS + 1))
    reference = dict(ref.losses)
    root = tmp_path / "run"
    ckpts = root / "checkpoint"

    stopped = run_example(JOB, root, *args, stop_at=4, sig=signal.SIGTERM, step_sleep=0.2, fresh=True)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert stopped.last is not None and committed_steps(ckpts)[-1] == stopped.last  # no printed step lost
    _check(stopped, reference)

    killed = run_example(JOB, root, *args, stop_at=9, sig=signal.SIGKILL, step_sleep=0.2, fresh=True)
    assert killed.returncode == -signal.SIGKILL
    assert killed.first == stopped.last + 1
    _check(killed, reference)
    # step 9's async write may not have committed before the kill (nor step 12's started, if very slow)
    newest = committed_steps(ckpts)[-1]
    assert newest in (6, 9, 12) and newest <= (killed.last or 0), newest

    final = run_example(JOB, root, *args, fresh=True)
    assert final.returncode == 0, final.stderr[-3000:]
    if newest < STEPS:
        assert (final.first, final.last) == (newest + 1, STEPS)
    _check(final, reference)
    assert committed_steps(ckpts)[-1] == STEPS  # the last step is saved (and written) too


def _objects(seed: int) -> dict[str, Any]:
    """What torchtitan's trainer builds and hands its checkpointer, from ``seed``."""
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    from tests.integrations.torchtitan_job import TrainState, build_loader

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    optimizers = default_adamw(lr=1e-2, implementation="for-loop").build(model_parts=[model])
    return {
        "model_parts": [model],
        "optimizers": optimizers,
        "lr_schedulers": LRSchedulersContainer.Config(warmup_steps=3).build(
            optimizers=optimizers, training_steps=10
        ),
        "dataloader": build_loader(),
        "states": {"train_state": TrainState()},
        "sd_adapter": None,
    }


def _train(objs: dict[str, Any], ckpt: Any, steps: int) -> None:
    data = objs.setdefault("iterator", iter(objs["dataloader"]))
    model, state = objs["model_parts"][0], objs["states"]["train_state"]
    for _ in range(steps):
        state.step += 1
        x, y = next(data)
        nn.functional.mse_loss(model(x), y).backward()
        ckpt.maybe_wait_for_staging()
        objs["optimizers"].step()
        objs["lr_schedulers"].step()
        objs["optimizers"].zero_grad()
        state.ntokens_seen += x.numel()
        ckpt.save(state.step)


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    sd_a, sd_b = a["model_parts"][0].state_dict(), b["model_parts"][0].state_dict()
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    oa, ob = a["optimizers"].state_dict(), b["optimizers"].state_dict()
    assert oa.keys() == ob.keys()
    for k in oa:
        assert torch.equal(oa[k], ob[k]) if isinstance(oa[k], torch.Tensor) else oa[k] == ob[k], k
    assert a["lr_schedulers"].state_dict() == b["lr_schedulers"].state_dict()
    # the data position: the next batch of the trained run's iterator is the fresh loader's first
    assert all(
        torch.equal(u, v) for u, v in zip(next(a["iterator"]), next(iter(b["dataloader"])), strict=True)
    )
    assert a["states"]["train_state"].state_dict() == b["states"]["train_state"].state_dict()


def test_fresh_objects_load_the_state_bit_for_bit(tmp_path: Path) -> None:
    from torchtitan.components.checkpointer.base import BaseCheckpointManager

    from safepoint.integrations.torchtitan import SafepointCheckpointManager

    config = SafepointCheckpointManager.Config(enable=True, interval=2, keep_latest_k=2)
    assert isinstance(config, BaseCheckpointManager.Config)
    trained = _objects(0)
    ckpt = config.build(**trained, base_folder=str(tmp_path))
    assert isinstance(ckpt, SafepointCheckpointManager)
    assert ckpt.load() is False  # a fresh start
    _train(trained, ckpt, 6)
    assert ckpt.save_future is not None  # step 6 is being written in the background
    ckpt.maybe_wait_for_saving()
    assert ckpt.save_future is None
    ckpt.close()
    assert committed_steps(tmp_path / "checkpoint") == [4, 6]  # keep_latest_k=2

    fresh = _objects(1)  # other weights, an empty optimizer state, step 0
    loader = config.build(**fresh, base_folder=str(tmp_path))
    try:
        assert loader.load() is True
        _assert_same(trained, fresh)
    finally:
        loader.close()


def test_exclude_from_loading_leaves_that_part(tmp_path: Path) -> None:
    from safepoint.integrations.torchtitan import SafepointCheckpointManager

    trained = _objects(0)
    ckpt = SafepointCheckpointManager.Config(enable=True, interval=2).build(
        **trained, base_folder=str(tmp_path)
    )
    _train(trained, ckpt, 2)
    ckpt.close()
    config = SafepointCheckpointManager.Config(enable=True, exclude_from_loading=["lr_scheduler"])
    fresh = _objects(1)
    before = fresh["lr_schedulers"].state_dict()
    loader = config.build(**fresh, base_folder=str(tmp_path))
    try:
        assert loader.load() is True
        assert fresh["lr_schedulers"].state_dict() == before
        assert fresh["states"]["train_state"].step == 2
    finally:
        loader.close()


def test_torchtitans_command_line_sets_the_config() -> None:
    from safepoint.integrations.torchtitan import SafepointCheckpointManager

    tyro = pytest.importorskip("tyro")
    args = ["--enable", "--interval", "7", "--no-async-save", "--keep-latest-k", "3"]
    config = tyro.cli(SafepointCheckpointManager.Config, args=args)
    assert (config.enable, config.interval, config.async_save, config.keep_latest_k) == (True, 7, False, 3)


def test_disabled_and_refused_options(tmp_path: Path) -> None:
    from safepoint.integrations.torchtitan import SafepointCheckpointManager

    off = SafepointCheckpointManager.Config().build(**_objects(0), base_folder=str(tmp_path))
    assert off.save(10) is False and off.load() is False
    off.close()
    assert not (tmp_path / "checkpoint").exists()
    with pytest.raises(ValueError, match="last_save_in_hf"):
        SafepointCheckpointManager.Config(enable=True, last_save_in_hf=True)
    with pytest.raises(ValueError, match="train_state"):
        SafepointCheckpointManager.Config(enable=True, exclude_from_loading=["train_state"])


def _torchrun(root: Path, *args: str) -> list[tuple[int, str]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(Path(__file__).with_name("torchtitan_job.py")), "--root", str(root), *args]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{REPO}",
    )
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return [(int(m[1]), m[2]) for m in re.finditer(r"^step (\d+) loss (\S+)$", done.stdout, re.M)]


@pytest.mark.slow  # three 2-rank torchrun jobs (~30 s on the 2-core VM)
def test_fsdp2_two_ranks_resume_bit_for_bit(tmp_path: Path) -> None:
    """torchtitan's data parallelism (FSDP2 ``fully_shard``, a data shard per rank) on gloo: a job that ends
    after step 5 resumes in a new torchrun from step 3, its losses the uninterrupted run's."""
    args = ("--steps", "8", "--save-every", "3")
    reference = dict(_torchrun(tmp_path / "reference", *args))
    assert sorted(reference) == list(range(1, 9))
    first = _torchrun(tmp_path / "run", *args, "--stop-after", "5")
    assert committed_steps(tmp_path / "run" / "checkpoint") == [3]
    second = _torchrun(tmp_path / "run", *args)
    assert [s for s, _ in second] == list(range(4, 9))
    different = [(s, loss, reference[s]) for s, loss in first + second if loss != reference[s]]
    assert different == [], different[:5]
