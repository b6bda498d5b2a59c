"""A CUDA wrapper tensor subclass (torchao's NF4Tensor, QLoRA's frozen 4-bit base on the GPU) through async
staging: its inner tensors get pinned host buffers, one set for many saves, and an async save through either
writer stores and restores what a sync save does (save/wrappers.py; the CPU side of it is
tests/save/test_wrapper_staging.py). Needs a GPU and torchao; skips without either. Written on a day without
a GPU: not yet run (docs/async.md "Wrapper tensor subclasses")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import safepoint
from safepoint.save.shared_buffers import buffer_tensors
from safepoint.save.staging import Stager
from tests.helpers.stored_items import stored

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _nf4() -> Any:
    return pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")


class _Bufs(torch.nn.Module):
    def __init__(self, **tensors: torch.Tensor) -> None:
        super().__init__()
        for k, v in tensors.items():
            self.register_buffer(k, v)


def _weights(nf4: Any) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = {"w0": (2048, 2048), "w1": (256, 512)}
    return {
        k: nf4.to_nf4(torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g))
        for k, s in shapes.items()
    }


@pytest.mark.parametrize("shared", [False, True], ids=["thread-buffers", "process-arena"])
def test_a_cuda_nf4_base_stages_into_pinned_buffers_once(shared: bool) -> None:
    nf4 = _nf4()
    weights = _weights(nf4)
    stager = Stager(shared=shared)
    try:
        for _ in range(3):
            snap = stager.stage(dict(weights))
        assert stager.allocations == 1
        assert all(t.is_pinned() and t.is_cpu for t in buffer_tensors(snap))
        for k, w in weights.items():
            assert type(snap[k]) is nf4.NF4Tensor
            assert torch.equal(snap[k].quantized_data, w.quantized_data.cpu())
    finally:
        stager.release()


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_cuda_nf4_base_saves_async_as_it_saves_sync(tmp_path: Path, mode: str) -> None:
    nf4 = _nf4()
    weights = _weights(nf4)
    for name in ("sync", mode):
        writer = safepoint.WriterOptions(async_writer="thread" if name == "sync" else name, if_busy="wait")
        with safepoint.CheckpointManager(tmp_path / name, async_save=name != "sync", writer=writer) as mgr:
            if name == "process":
                assert mgr._process is not None
                mgr._process.wait_ready()
            for step in (1, 2):
                mgr.save(step, safepoint.TrainState(model=_Bufs(**weights), rng=False))
                mgr.wait()
    want, got = stored(tmp_path / "sync" / "step-2"), stored(tmp_path / mode / "step-2")
    for key, v in want.items():
        assert type(got[key]) is type(v) is nf4.NF4Tensor, key
        assert torch.equal(got[key].quantized_data, v.quantized_data)
        assert torch.equal(got[key].get_original_weight(), v.get_original_weight())
    back = _Bufs(**{k: nf4.to_nf4(torch.zeros_like(w.get_original_weight())) for k, w in weights.items()})
    with safepoint.CheckpointManager(tmp_path / mode) as mgr:
        assert mgr.restore(safepoint.TrainState(model=back, rng=False)) == 2
    for k, w in weights.items():
        assert torch.equal(getattr(back, k).get_original_weight(), w.get_original_weight())
