"""torchtitan's default Llama 3 debug model (its attention's ``wq``/``wk``/``wv`` fused into one ``wqkv``)
through ``SafepointCheckpointManager``, compared with torchtitan's own DCP checkpointer.

``FusedQKVLinear`` saves its one ``wqkv`` parameter as the stock ``wq``/``wk``/``wv`` keys (a state-dict
post-hook) and merges them back on load (a pre-hook). DCP's ``get_state_dict`` failed on those keys
(``AttributeError: 'FusedQKVLinear' object has no attribute 'wq'``), so the checkpointer could not save
this model. Checked here, with torchtitan's real model class on CPU (tests/integrations/torchtitan_models.py):

- the checkpoint holds what torchtitan's own ``CheckpointManager`` writes for the same state, bit for bit:
  the model in the stock layout (``ModelWrapper``'s keys), the optimizer state keyed by ``wqkv``;
- fresh torchtitan objects load it bit for bit (the fused parameters, the optimizer as torchtitan's
  ``OptimizersContainer`` reports it, the scheduler), and the next step's loss is the trained run's;
- the stock layout loads into the unfused model too, as torchtitan's hooks promise;
- (slow) two ranks, ``wqkv`` sharded by FSDP2 and by tensor parallelism: fresh sharded objects restore bit
  for bit.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import safepoint
from tests.conftest import REPO, SUBPROCESS_ENV
from tests.integrations.torchtitan_models import debug_model, train_step

STEP = 2
LAYERS = 2  # two of the debug model's six blocks: the same classes, a third of the build time
FUSED = "layers.0.attention.qkv_linear.wqkv.weight"
SPLIT = [f"layers.0.attention.qkv_linear.{w}.weight" for w in ("wq", "wk", "wv")]


@pytest.fixture(autouse=True, scope="module")
def _needs_torchtitan() -> None:
    # Asked when a test of this module runs, not at its import: every xdist worker imports each test module
    # to collect it, and only the worker that runs these tests should pay for torchtitan.
    pytest.importorskip("torchtitan.components.checkpointer.base")


def _objects(seed: int) -> dict[str, Any]:
    """What torchtitan's trainer hands its checkpointer, around the fused debug model."""
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    from tests.integrations.torchtitan_job import TrainState, build_loader

    model = debug_model(seed, layers=LAYERS)
    optimizers = default_adamw(lr=1e-3, implementation="for-loop").build(model_parts=[model])
    return {
        "model_parts": [model],
        "optimizers": optimizers,
        "lr_schedulers": LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=optimizers, training_steps=10
        ),
        "dataloader": build_loader(),
        "states": {"train_state": TrainState()},
        "sd_adapter": None,
    }


def _step(objs: dict[str, Any], step: int) -> float:
    loss = train_step(objs["model_parts"][0], objs["optimizers"], step)
    objs["lr_schedulers"].step()
    objs["states"]["train_state"].step = step
    return loss


def _saved(step_dir: Path, like: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The tensors ``like`` names, read from a DCP checkpoint with plain ``dcp.load`` (under ``prefix``)."""
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load({prefix: out} if prefix else out, checkpoint_id=str(step_dir))
    return out


def _equal(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])]


def test_fused_debug_model_saves_as_torchtitan_does_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.components.checkpointer.dcp import CheckpointManager

    from safepoint.integrations.torchtitan import SafepointCheckpointManager

    trained = _objects(0)
    model = trained["model_parts"][0]
    assert FUSED in dict(model.named_parameters()) and set(SPLIT) <= model.state_dict().keys()
    for step in range(1, STEP + 1):
        _step(trained, step)

    titan = CheckpointManager.Config(enable=True, folder="titan", interval=1, keep_latest_k=0)
    # torchtitan's own DCP checkpointer; it adds its model/optimizer/... to the states dict it is given
    own = titan.build(**{**trained, "states": dict(trained["states"])}, base_folder=str(tmp_path))
    assert own.save(STEP) is True
    own.close()
    ours = SafepointCheckpointManager.Config(enable=True, folder="safepoint", interval=1)
    ckpt = ours.build(**trained, base_folder=str(tmp_path))  # async: staged, written in the background
    assert ckpt.save(STEP) is True
    ckpt.maybe_wait_for_saving()
    ckpt.close()

    # The same bytes as torchtitan's: the model in its stock layout, the optimizer state keyed by wqkv.
    wrapper = {k: v.clone() for k, v in ModelWrapper(model).state_dict().items()}
    theirs, mine = tmp_path / "titan" / f"step-{STEP}", tmp_path / "safepoint" / f"step-{STEP}"
    assert _equal(_saved(theirs, wrapper, ""), wrapper) == []
    assert _equal(_saved(mine, wrapper, "model"), wrapper) == []
    their_keys = FileSystemReader(str(theirs)).read_metadata().state_dict_metadata
    optim_state = {k: torch.zeros(m.size, dtype=m.properties.dtype)
                   for k, m in their_keys.items() if k.startswith("optimizer.state.")}  # fmt: skip
    assert any(FUSED in k for k in optim_state)
    dcp.load(optim_state, checkpoint_id=str(theirs))
    assert _equal(_saved(mine, optim_state, ""), optim_state) == []

    fresh = _objects(1)  # other weights, an empty optimizer state, step 0
    loader = ours.build(**fresh, base_folder=str(tmp_path))
    try:
        assert loader.load() is True
    finally:
        loader.close()
    params = dict(fresh["model_parts"][0].named_parameters())
    assert _equal(params, dict(model.named_parameters())) == []
    assert _equal(fresh["optimizers"].state_dict(), trained["optimizers"].state_dict()) == []
    assert fresh["lr_schedulers"].state_dict() == trained["lr_schedulers"].state_dict()
    assert fresh["states"]["train_state"].step == STEP
    assert _step(fresh, STEP + 1) == _step(trained, STEP + 1)

    # The stock layout is the unfused model's: it loads there too (torchtitan's hooks' promise).
    unfused = debug_model(2, fuse_qkv=False, layers=LAYERS)
    with safepoint.CheckpointManager(tmp_path / "safepoint") as mgr:
        assert mgr.restore(safepoint.TrainState(model=unfused, rng=False), STEP) == STEP
    assert _equal(dict(unfused.state_dict()), wrapper) == []


@pytest.mark.slow  # one 2-rank torchrun that builds the model four times (~45 s on the loaded 2-core VM)
def test_fused_model_sharded_on_two_ranks_restores_bit_for_bit(tmp_path: Path) -> None:
    """FSDP2 and tensor parallelism shard ``wqkv`` (a DTensor the hook gathers before splitting it): fresh
    sharded objects restore the checkpoint bit for bit (tests/integrations/torchtitan_fused_ranks_job.py)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(Path(__file__).with_name("torchtitan_fused_ranks_job.py")), str(tmp_path)]
    env = dict(SUBPROCESS_ENV, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    # (the two ranks' lines may interleave in torchrun's output: matched, not split by line)
    found = sorted(re.findall(r"(fsdp|tp) rank (\d) keys (\d+) different (\[[^\]]*\])", done.stdout))
    # every parameter and its AdamW state (step, exp_avg, exp_avg_sq): 17 parameters in two blocks
    assert found == [(layout, str(r), "68", "[]") for layout in ("fsdp", "tp") for r in (0, 1)]
