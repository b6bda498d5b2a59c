"""A 2-rank job for tests/restore/test_optimizer_without_state.py: a sharded (FSDP2) or replicated (DDP) model
with a layer that gets no gradient before the save is restored into a fresh model and optimizer and trained
on, beside the uninterrupted run. argv: root, out (JSON per rank: what differs)."""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import safepoint
from tests.helpers.procs.exiting import run_then_exit


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)
        self.late = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return y + self.unused(x) if self.late else y


def build(kind: str) -> tuple[nn.Module, Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = Net()
    model: nn.Module = net
    if kind == "fsdp2":
        fully_shard(net, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    else:
        model = nn.parallel.DistributedDataParallel(net, find_unused_parameters=True)
    return model, net, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    g = torch.Generator().manual_seed(100 * i + dist.get_rank())
    model(torch.randn(3, 4, generator=g)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def train_on(model: nn.Module, net: Net, opt: torch.optim.Optimizer) -> None:
    for i in range(2, 6):  # two steps without ``unused``, then two with it
        net.late = i >= 4
        step(model, opt, i)


def full(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "model": get_model_state_dict(model, options=opts),
        "optim": get_optimizer_state_dict(model, opt, options=opts),
    }


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}.{i}")
        ]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return (
            []
            if same
            else [f"{path}: {a.dtype} {a.flatten()[:2].tolist()} != {b.dtype} {b.flatten()[:2].tolist()}"]
        )
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def run(kind: str, root: str) -> dict[str, Any]:
    model, net, opt = build(kind)
    for i in range(2):
        step(model, opt, i)
    saved_states = len(opt.state)
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(2, safepoint.TrainState(model=model, optimizer=opt))
    at_save = copy.deepcopy(full(model, opt))  # 0-d ``step`` tensors alias the live state
    train_on(model, net, opt)
    model2, net2, opt2 = build(kind)
    with safepoint.CheckpointManager(root) as mgr:
        restored = mgr.restore(safepoint.TrainState(model=model2, optimizer=opt2))
    found = {"restored": restored, "states": [saved_states, len(opt2.state)]}
    found["at_restore"] = differences(at_save, full(model2, opt2))
    train_on(model2, net2, opt2)
    found["after"] = differences(full(model, opt), full(model2, opt2))
    return found


def main() -> None:
    root, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    found = {kind: run(kind, f"{root}/{kind}") for kind in ("fsdp2", "ddp")}
    with open(f"{out}.{dist.get_rank()}", "w") as f:
        json.dump(found, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_then_exit(main)  # never through the interpreter's teardown (tests/helpers/procs/exiting.py)
