"""Every value of an async save's snapshot is a copy that no later write to the live state can reach.

torch's ``_create_cpu_state_dict`` (which allocates the staging buffers) returns a 0-d DTensor as it is: an
FSDP2 or tensor-parallel scalar parameter and its Adam moments were "staged" into themselves, so the
optimizer step after ``save()`` returned reached the checkpoint still being written (a later step's value
restored: bitwise resume broken without a sign). These check the snapshot against in-place writes made
after staging, for every kind of item ``_create_cpu_state_dict`` and the walk treat apart, and end to end
with the background write held open while the next optimizer step runs."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import safepoint
from safepoint.save.staging import Stager


def _data(v: Any) -> torch.Tensor:
    """The plain tensor holding an item's data (a DTensor's local tensor)."""
    return v._local_tensor if isinstance(v, DTensor) else v


def _kinds() -> dict[str, Callable[[], Any]]:
    mesh = init_device_mesh("cpu", (1,))
    return {
        "dtensor-0d": lambda: distribute_tensor(torch.tensor(2.5), mesh, [Replicate()]),
        "dtensor-0d-param": lambda: nn.Parameter(distribute_tensor(torch.tensor(-1.5), mesh, [Replicate()])),
        "dtensor-0d-int": lambda: distribute_tensor(torch.tensor(7), mesh, [Replicate()]),
        "dtensor": lambda: distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]),
        "dtensor-zero-size": lambda: distribute_tensor(torch.empty(0, 3), mesh, [Shard(0)]),
        "dtensor-empty-local-shard": lambda: DTensor.from_local(
            torch.empty(0, 3), mesh, [Shard(0)], run_check=False, shape=torch.Size([2, 3]), stride=(3, 1)
        ),
        "tensor-0d": lambda: torch.tensor(3.0),
        "tensor-zero-size": lambda: torch.empty(0, 4),
        "tensor": lambda: torch.randn(5),
    }


KINDS = [
    "dtensor-0d",  # returned as it is by torch: the bug
    "dtensor-0d-param",
    "dtensor-0d-int",
    "dtensor",
    "dtensor-zero-size",
    "dtensor-empty-local-shard",
    "tensor-0d",
    "tensor-zero-size",
    "tensor",
]


@pytest.mark.parametrize("kind", KINDS)
def test_no_write_after_staging_reaches_the_snapshot(one_rank_group: None, stager: Stager, kind: str) -> None:
    make = _kinds()[kind]
    sd: dict[str, Any] = {
        "x": make(),
        "nested": {"y": make(), "seq": [make(), (make(), 1)]},
        "w": torch.ones(3),
    }
    items = [sd["x"], sd["nested"]["y"], sd["nested"]["seq"][0], sd["nested"]["seq"][1][0]]
    for _ in range(2):  # the first staging allocates, the second reuses the buffers
        snap = stager.stage(sd)
        staged = [snap["x"], snap["nested"]["y"], snap["nested"]["seq"][0], snap["nested"]["seq"][1][0]]
        want = [_data(v).clone() for v in items]
        for live, got in zip(items, staged, strict=True):
            assert got is not live and isinstance(got, DTensor) == isinstance(live, DTensor), kind
            if isinstance(live, DTensor):
                assert (got.placements, got.shape) == (live.placements, live.shape), kind
            a, b = _data(live), _data(got)
            assert b is not a and (a.numel() == 0 or b.data_ptr() != a.data_ptr()), kind
        with torch.no_grad():  # the next training step writes the live state in place
            for v in items:
                _data(v).fill_(99)
        for got, w in zip(staged, want, strict=True):
            assert torch.equal(_data(got), w), kind
    assert stager.allocations == 1


def test_a_bytesio_value_is_copied_into_the_snapshot(stager: Stager) -> None:
    # Not reachable through a manager (capture refuses a BytesIO: restore could not load it), but the
    # stager's own promise: no value of its snapshot is the live object.
    live = io.BytesIO(b"step-3")
    live.seek(2)
    snap = stager.stage({"blob": live, "w": torch.ones(2)})
    live.seek(0)
    live.write(b"step-4")
    assert snap["blob"] is not live
    assert (snap["blob"].getvalue(), snap["blob"].tell()) == (b"step-3", 2)


class _Scaled(nn.Module):
    """A tensor-parallel style module with a learnable scalar: a 0-d DTensor parameter, and Adam's two
    moments of it 0-d DTensors too."""

    def __init__(self) -> None:
        super().__init__()
        mesh = init_device_mesh("cpu", (1,))
        self.scale = nn.Parameter(distribute_tensor(torch.tensor(2.0), mesh, [Replicate()]))
        self.w = nn.Parameter(distribute_tensor(torch.linspace(-1.0, 1.0, 6), mesh, [Replicate()]))

    def forward(self) -> torch.Tensor:
        return (self.scale * self.w).pow(2).sum()


def _train(model: _Scaled, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model().backward()
    opt.step()


def _values(model: _Scaled, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        for k, v in opt.state[p].items():
            out[f"opt.{name}.{k}"] = v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
    return out


@pytest.mark.parametrize(
    "writer",
    ["thread", pytest.param("process", marks=pytest.mark.slow)],  # staged alike: test_* above
)
def test_the_step_after_an_async_save_never_reaches_its_checkpoint(
    one_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    torch.manual_seed(0)
    model = _Scaled()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _train(model, opt)
    with safepoint.CheckpointManager(
        tmp_path / "ckpt", async_save=True, writer=safepoint.WriterOptions(async_writer=writer)
    ) as mgr:
        if mgr._process is not None:
            mgr._process.wait_ready()  # the process writes this save, not the thread while it starts
        # The background write waits until the next step has run: what it writes is only the snapshot.
        held = threading.Event()
        real = mgr._bg_saver.write  # type: ignore[union-attr]

        def write(*args: Any, **kwargs: Any) -> Any:
            assert held.wait(60)
            return real(*args, **kwargs)

        monkeypatch.setattr(mgr._bg_saver, "write", write)
        want = _values(model, opt)
        assert mgr.save(1, safepoint.TrainState(model=model, optimizer=opt, rng=False)) is None
        _train(model, opt)  # Adam writes scale, exp_avg and exp_avg_sq (all 0-d DTensors) in place
        assert not torch.equal(model.scale.full_tensor(), want["model.scale"])
        held.set()
        mgr.wait()
        fresh = _Scaled()
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
        _train(fresh, fresh_opt)  # lazily created optimizer state, overwritten by the restore
        assert mgr.restore(safepoint.TrainState(model=fresh, optimizer=fresh_opt, rng=False)) == 1
    got = _values(fresh, fresh_opt)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k}: {got[k]} restored, {want[k]} at save()"
