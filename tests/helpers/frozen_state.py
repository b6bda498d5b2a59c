"""The state of the incremental object-store tests (tiered: tests/remote/test_incremental_stores.py;
straight to a bucket: tests/remote/test_incremental_direct.py): a frozen tensor beside one that changes,
and the check that a step downloaded by itself is a whole checkpoint."""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import safepoint
from safepoint.remote.object_layout import RemoteLayout
from safepoint.remote.upload import MiB
from tests.helpers.tcpproxy import TcpProxy

BASE = 4 * MiB  # the frozen tensor's bytes
ADAPTER = 1000  # float32s that change every save: 4,000 bytes


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Parameter(torch.randn(BASE // 4), requires_grad=False)  # never changes
        self.adapter = nn.Parameter(torch.zeros(ADAPTER))


def snapshot(model: Frozen) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def saves_counted(
    mgr: safepoint.CheckpointManager,
    model: Frozen,
    proxy: TcpProxy,
    steps: range = range(1, 5),
    *,
    wait: bool = False,
) -> tuple[dict[int, int], dict[int, dict[str, torch.Tensor]]]:
    """``steps`` of ``model``, its adapter changed before each: the bytes ``proxy`` saw go up for each save
    (``wait``: its background write or upload counted with it) and the state each step holds."""
    state = safepoint.TrainState(model=model)
    up: dict[int, int] = {}
    saved: dict[int, dict[str, torch.Tensor]] = {}
    for step in steps:
        with torch.no_grad():
            model.adapter.add_(1.0)
        proxy.reset_counts()
        mgr.save(step, state)
        if wait:
            mgr.wait()
        up[step] = proxy.up
        saved[step] = snapshot(model)
    return up, saved


def assert_restores_alone(
    fs: Any, layout: RemoteLayout, step: int, saved: dict[str, torch.Tensor], tmp: Path
) -> None:
    """``step`` downloaded by itself: plain ``dcp.load`` reads it, and safepoint restores it, bit for bit."""
    alone = tmp / f"alone-{step}"
    fs.get(posixpath.join(layout.step_key(step), ""), str(alone / f"step-{step}") + "/", recursive=True)
    sd = {"model": {k: torch.zeros_like(v) for k, v in saved.items()}}
    dcp.load(sd, checkpoint_id=str(alone / f"step-{step}"))
    for k, v in saved.items():
        assert torch.equal(sd["model"][k], v), (step, k)
    fresh = Frozen()
    with safepoint.CheckpointManager(alone) as mgr:
        assert mgr.restore(safepoint.TrainState(model=fresh)) == step
    for k, v in saved.items():
        assert torch.equal(fresh.state_dict()[k], v), (step, k)
