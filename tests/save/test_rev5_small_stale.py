"""rev5 review: a small CPU tensor (copied at async staging, fingerprinted by the writer) changed in place
without a version bump, after it was linked from the previous checkpoint, is written again: an incremental
async save never links stale bytes (save/staging.py ``FINGERPRINT_CPU_MIN_BYTES``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import safepoint
from safepoint.save import staging


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.register_buffer("table", torch.randn(500))
        self.trained = nn.Linear(4, 4)


@pytest.mark.parametrize(
    ("how", "writer"),
    [("numpy", "thread"), ("data", "thread"), ("inference", "thread"), ("numpy", "process")],
)
def test_a_small_tensor_changed_without_a_version_bump_is_written(root: Path, how: str, writer: str) -> None:
    if writer == "process" and not hasattr(os, "memfd_create"):
        pytest.skip("the process writer is Linux-only")
    torch.manual_seed(0)
    model = _Small()
    opt = torch.optim.Adam(model.trained.parameters())
    state = safepoint.TrainState(model=model, optimizer=opt, rng=False)
    assert all(int(t.nbytes) < staging.FINGERPRINT_CPU_MIN_BYTES for t in model.state_dict().values())
    with safepoint.CheckpointManager(
        root, async_save=True, writer=safepoint.WriterOptions(async_writer=writer)
    ) as mgr:
        for step in (1, 2, 3, 4):
            if step == 4:  # linked at step 3; now changed behind the version counter's back
                table, weight = model.table, model.frozen.weight
                v = (table._version, weight._version)
                if how == "numpy":
                    table.numpy()[3] = 1234.0
                    weight.detach().numpy()[0, 0] = -99.0
                elif how == "data":
                    table.data[3] = 1234.0
                    weight.data[0, 0] = -99.0
                else:
                    with torch.inference_mode():
                        table[3] = 1234.0
                        weight[0, 0] = -99.0
                if how != "inference":
                    assert (table._version, weight._version) == v
            model.trained(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            mgr.save(step, state)
            mgr.wait()
    torch.manual_seed(1)
    fresh = _Small()
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(model=fresh, rng=False)) == 4
    assert fresh.table[3].item() == 1234.0 and fresh.frozen.weight[0, 0].item() == -99.0
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
