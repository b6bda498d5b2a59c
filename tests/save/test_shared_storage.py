"""Keys that are different views of one storage (slices of one buffer, a view and its base, a transpose):
DCP's format gives each such key a record of its own (docs/incremental.md, "Views of one buffer"), so
their shared bytes are written once per key; what must hold is that every key restores bit for bit, in
sync and async saves, incremental ones included, with plain ``dcp.load`` and after a resume into fresh
objects (whose views still share their buffer). A conj or neg view has the memory, dtype, shape and
strides of its base and other values: it is never taken for a tied weight."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import safepoint
from safepoint.store.storage import read_metadata_file

ROWS, COLS = 64, 48


class Views(nn.Module):
    """A parameter and buffers that are views of it, and slices of one flat buffer, as packed or fused
    layers keep them."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(ROWS, COLS))
        w = self.w.detach()
        self.register_buffer("top", w[: ROWS // 2])  # a view and its base, same start
        self.register_buffer("bottom", w[ROWS // 2 :])  # another slice of the same parameter
        self.register_buffer("wt", w[:COLS, :COLS].t())  # a strided (transposed) view
        flat = torch.randn(4096)
        self.register_buffer("flat", flat)
        self.register_buffer("a", flat[:1000].view(40, 25))  # two slices of one flat buffer ...
        self.register_buffer("b", flat[900:3000])  # ... that overlap
        self.register_buffer("every_other", flat[::2])  # non-contiguous
        self.register_buffer("same_start", flat.view(64, 64))  # same data_ptr, another shape
        # Same memory, dtype, shape and strides, other values: not tied weights (the conj and neg bits).
        z = torch.randn(300, dtype=torch.complex64)
        self.register_buffer("z", z)
        self.register_buffer("z_conj", z.conj())
        self.register_buffer("neg", torch._neg_view(flat))

    def shares(self) -> bool:
        """Whether the views still view their bases (a restore must not break them apart)."""
        w, flat = self.w.untyped_storage().data_ptr(), self.flat.untyped_storage().data_ptr()
        z = self.z.untyped_storage().data_ptr()
        views = (self.a, self.b, self.every_other, self.same_start, self.neg)
        return (
            all(t.untyped_storage().data_ptr() == w for t in (self.top, self.bottom, self.wt))
            and all(t.untyped_storage().data_ptr() == flat for t in views)
            and self.z_conj.untyped_storage().data_ptr() == z
            and self.z_conj.is_conj()
            and self.neg.is_neg()
        )


def _step(model: Views, n: int) -> None:
    with torch.no_grad():
        model.w[n % ROWS].add_(1.0)  # one row of the parameter changes, through its base
        if n % 2:
            model.flat[3500:].mul_(0.5)  # the flat buffer changes only outside a and b, every other step
        if n == 3:
            model.z.mul_(1j)


def _values(t: torch.Tensor) -> torch.Tensor:
    return t.detach().resolve_conj().resolve_neg().clone()


def _snapshot(model: Views) -> dict[str, torch.Tensor]:
    return {k: _values(v) for k, v in model.state_dict().items()}


def _equal(model: Views, snap: dict[str, torch.Tensor], what: str) -> None:
    got = model.state_dict()
    assert set(got) == set(snap)
    for k, v in snap.items():
        assert torch.equal(_values(got[k]), v), (what, k)


@pytest.mark.parametrize(
    "writer",
    [
        "sync",
        "thread",
        pytest.param("process", marks=pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="Linux")),
    ],
)
def test_views_of_one_buffer_restore_bit_for_bit(tmp_path: Path, writer: str) -> None:
    root = tmp_path / "root"
    torch.manual_seed(0)
    model = Views()
    assert model.shares()
    state = safepoint.TrainState(model=model)
    opts = {"async_save": writer != "sync"}
    wopts = safepoint.WriterOptions(async_writer=writer) if writer != "sync" else safepoint.WriterOptions()
    saved: dict[int, dict[str, torch.Tensor]] = {}
    with safepoint.CheckpointManager(root, keep=safepoint.Keep(last=4), writer=wopts, **opts) as mgr:
        for step in range(1, 5):
            _step(model, step)
            mgr.save(step, state)
            mgr.wait()
            saved[step] = _snapshot(model)
    # Every key has a record of its own: DCP cannot map a key to part of another key's record.
    md = read_metadata_file(root / "step-4" / ".metadata")
    where = {idx.fqn: (info.relative_path, info.offset) for idx, info in md.storage_data.items()}
    keys = [k for k in where if k.startswith("model.")]
    assert len({where[k] for k in keys}) == len(keys)
    for step in range(1, 5):
        # plain dcp.load ...
        sd = {"model": {k: torch.zeros_like(v) for k, v in saved[step].items()}}
        dcp.load(sd, checkpoint_id=str(root / f"step-{step}"))
        for k, v in saved[step].items():
            assert torch.equal(sd["model"][k], v), (step, k)
    # ... and a resume into fresh objects, whose views still view one buffer afterwards.
    torch.manual_seed(1)
    fresh = Views()
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(model=fresh)) == 4
    _equal(fresh, saved[4], "resume")
    assert fresh.shares()
    # A step copied alone restores too (its files may be links shared with other steps).
    alone = tmp_path / "alone"
    shutil.copytree(root / "step-3", alone / "step-3")
    shutil.rmtree(root)
    torch.manual_seed(2)
    fresh = Views()
    with safepoint.CheckpointManager(alone) as mgr:
        assert mgr.restore(safepoint.TrainState(model=fresh)) == 3
    _equal(fresh, saved[3], "alone")
    assert fresh.shares()
