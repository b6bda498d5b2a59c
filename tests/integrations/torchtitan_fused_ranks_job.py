"""torchtitan's fused-``wqkv`` Llama 3 debug model (two of its blocks) on two ranks, saved and restored through
safepoint (tests/integrations/test_torchtitan_fused.py, ``-m slow``):

    torchrun --nproc-per-node 2 torchtitan_fused_ranks_job.py ROOT

Two layouts, each into its own folder under ROOT: ``fsdp`` (FSDP2 ``fully_shard`` per block and at the root,
torchtitan's data parallelism; one real training step) and ``tp`` (``ColwiseParallel`` on ``wqkv``, ``w1``,
``w3``, ``RowwiseParallel`` on ``w2``, as torchtitan's tensor parallelism shards them; one AdamW step on
gradients of ones, since a forward pass would need the rest of torchtitan's TP plan). In both, ``wqkv`` is a
sharded DTensor that the layer's state-dict hook gathers before splitting it into ``wq``/``wk``/``wv``. Fresh
objects restore the checkpoint; each rank prints ``<layout> rank R keys N different [...]`` (the weights and
optimizer state gathered with ``full_tensor`` and compared bit for bit) and exits 3 if anything differs.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import safepoint
from tests.helpers.procs.exiting import run_then_exit
from tests.integrations.torchtitan_models import debug_model, train_step

LAYERS = 2


def _build(seed: int, layout: str, mesh: DeviceMesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = debug_model(seed, layers=LAYERS)
    for block in model.layers.values():
        if layout == "fsdp":
            fully_shard(block, mesh=mesh)
        else:
            plan = {"attention.qkv_linear.wqkv": ColwiseParallel(), "feed_forward.w1": ColwiseParallel(),
                    "feed_forward.w2": RowwiseParallel(), "feed_forward.w3": ColwiseParallel()}  # fmt: skip
            parallelize_module(block, mesh, plan)
    if layout == "fsdp":
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)


def _full(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    def whole(t: Any) -> Any:
        return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()

    out: dict[str, Any] = {}
    for name, param in model.named_parameters():
        out[name] = whole(param)
        for key, value in opt.state.get(param, {}).items():
            out[f"{name}.{key}"] = whole(value)
    return out


def main() -> None:
    root = sys.argv[1]
    safepoint.init_process_group("gloo", timeout_s=120)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    failed = False
    for layout in ("fsdp", "tp"):
        model, opt = _build(0, layout, mesh)
        assert isinstance(model.layers["0"].attention.qkv_linear.wqkv.weight, DTensor)
        if layout == "fsdp":
            train_step(model, opt, 1)
        else:
            for param in model.parameters():
                param.grad = torch.ones_like(param)
            opt.step()
            opt.zero_grad()
        with safepoint.CheckpointManager(f"{root}/{layout}", async_save=True) as mgr:
            mgr.save(1, safepoint.TrainState(model=model, optimizer=opt, rng=False))
        fresh, fresh_opt = _build(1, layout, mesh)
        with safepoint.CheckpointManager(f"{root}/{layout}") as mgr:
            assert mgr.restore(safepoint.TrainState(model=fresh, optimizer=fresh_opt, rng=False)) == 1
        want, got = _full(model, opt), _full(fresh, fresh_opt)
        different = sorted(k for k in want if k not in got or not torch.equal(want[k], got[k]))
        print(f"{layout} rank {rank} keys {len(want)} different {different[:5]}", flush=True)
        failed = failed or bool(different) or want.keys() != got.keys()
    dist.destroy_process_group()
    if failed:
        raise SystemExit(3)


if __name__ == "__main__":
    run_then_exit(main)
