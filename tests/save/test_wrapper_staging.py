"""An async save of a traceable wrapper tensor subclass (torchao's NF4Tensor: QLoRA's frozen 4-bit base)
writes what a sync save of it writes. Async staging allocated its buffers with torch's
``_create_cpu_state_dict``, which calls ``zeros_like`` on every wrapper (its data_ptr is 0): NF4Tensor
refuses that op, so the async save failed; a wrapper whose ``zeros_like``/``copy_`` unwrap (this suite's
WrapperTensor) was staged as a *plain* tensor, so the checkpoint held another item type than a sync
save's. Now the buffer is the wrapper rebuilt over staging buffers of its inner tensors
(save/wrappers.py), for both writers: the thread's, and the process's, which reads the inner tensors in
the shared segment."""

from __future__ import annotations

import logging
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import safepoint
from safepoint.save import handoff
from safepoint.save.staging import Stager
from tests.helpers.holder import Holder
from tests.helpers.stored_items import stored
from tests.helpers.wrapper_tensor import WrapperTensor

MODES = ["sync", "thread", "process"]


class _Keeping(WrapperTensor):
    """A wrapper whose detach and clone keep its own attributes (``__dict__`` beyond what flatten carries):
    a sync save pickles them (torch pickles a subclass's ``__dict__``), so an async save must too."""

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if isinstance(out, _Keeping) and isinstance(args[0], _Keeping):
            for k, v in args[0].__dict__.items():
                out.__dict__.setdefault(k, v)
        return out


class _Uncomparable:
    """A flatten context that equals nothing, not even a copy of itself (no ``__eq__``)."""

    def __init__(self, block: int) -> None:
        self.block = block


@pytest.fixture(autouse=True)
def _allowed() -> Iterator[None]:
    with torch.serialization.safe_globals([WrapperTensor, _Keeping]):  # allowlisted, as torchao's are
        yield


class _Bufs(torch.nn.Module):
    def __init__(self, **tensors: torch.Tensor) -> None:
        super().__init__()
        for k, v in tensors.items():
            self.register_buffer(k, v)


def _save(root: Path, mode: str, state: safepoint.TrainState, steps: int = 1) -> int:
    """``steps`` saves of ``state``, the process writer's once its process is ready (a save before that is
    written by the writer thread); the staging buffer sets allocated (0 for sync saves)."""
    writer = safepoint.WriterOptions(async_writer="thread" if mode == "sync" else mode, if_busy="wait")
    with safepoint.CheckpointManager(root, async_save=mode != "sync", writer=writer) as mgr:
        if mode == "process":
            assert mgr._process is not None
            mgr._process.wait_ready()
        for step in range(1, steps + 1):
            mgr.save(step, state)
            mgr.wait()
        return mgr._stager.allocations if mgr._stager is not None else 0


def _same_wrapper(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    assert a.__dict__.keys() == b.__dict__.keys()
    for k, v in a.__dict__.items():
        if isinstance(v, torch.Tensor):
            assert type(v) is type(b.__dict__[k]) and v.dtype == b.__dict__[k].dtype
            assert torch.equal(v, b.__dict__[k]), k
        else:
            assert v == b.__dict__[k], k


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_an_async_save_stores_the_wrapper_a_sync_save_stores(
    tmp_path: Path, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    def state() -> safepoint.TrainState:
        w = WrapperTensor(torch.arange(6.0).reshape(2, 3), {"block": 64})
        k = _Keeping(torch.arange(4, dtype=torch.int16), {"block": 32})
        k.extra = {"scale": 0.5}  # not in flatten: pickled with the wrapper's __dict__
        nested = WrapperTensor(WrapperTensor(torch.arange(4.0), 2), 1)
        objects = {"o": Holder(WrapperTensor(torch.ones(3), [1, 2])), "n": Holder(nested)}
        return safepoint.TrainState(model=_Bufs(w=w, k=k), objects=objects, rng=False)

    _save(tmp_path / "sync", "sync", state())
    with caplog.at_level(logging.INFO, logger="safepoint"):
        _save(tmp_path / mode, mode, state(), steps=2)
    assert "written by the thread" not in caplog.text  # the process wrote them
    assert "outside the staging segment" not in caplog.text
    want, got = stored(tmp_path / "sync" / "step-1"), stored(tmp_path / mode / "step-2")
    assert want.keys() == got.keys()
    assert type(want["model.w"]) is WrapperTensor and type(want["model.k"]) is _Keeping
    assert want["model.k"].extra == {"scale": 0.5}  # the control: a sync save stores the attribute
    assert type(want["objects.n.v"].packed) is WrapperTensor
    for key in ("model.w", "model.k", "objects.o.v", "objects.n.v"):
        _same_wrapper(got[key], want[key])
    # Restored into fresh templates: the same values either way.
    back = {}
    for name in ("sync", mode):
        tmpl = safepoint.TrainState(
            model=_Bufs(w=WrapperTensor(torch.zeros(2, 3), {"block": 64}),
                        k=_Keeping(torch.zeros(4, dtype=torch.int16), {"block": 32})),
            objects={"o": Holder(WrapperTensor(torch.zeros(3), [1, 2])),
                     "n": Holder(WrapperTensor(WrapperTensor(torch.zeros(4), 2), 1))}, rng=False,
        )  # fmt: skip
        with safepoint.CheckpointManager(tmp_path / name) as mgr:
            assert mgr.restore(tmpl) == (1 if name == "sync" else 2)
        back[name] = tmpl
    a, b = back["sync"], back[mode]
    for x, y in ((a.model.w, b.model.w), (a.model.k, b.model.k), (a.objects["o"].v, b.objects["o"].v),
                 (a.objects["n"].v, b.objects["n"].v)):  # fmt: skip
        _same_wrapper(x, y)


def test_the_snapshot_is_a_wrapper_over_its_own_memory(stager: Stager) -> None:
    live = _Keeping(torch.arange(8.0), {"block": 64})
    live.extra = {"seen": [1]}
    snap = stager.stage({"w": live})["w"]
    assert type(snap) is _Keeping and snap.meta == {"block": 64} and snap.extra == {"seen": [1]}
    assert snap.packed.data_ptr() != live.packed.data_ptr() and torch.equal(snap.packed, live.packed)
    live.packed.add_(1)  # a later write to the live state never reaches the snapshot
    live.meta["block"] = 1
    live.extra["seen"].append(2)
    assert torch.equal(snap.packed, torch.arange(8.0)) and snap.meta == {"block": 64}
    assert snap.extra == {"seen": [1]}
    if stager.arena is not None:  # the process writer's segment holds the inner tensor
        assert handoff.place_of(snap.packed, stager.arena) is not None


def test_a_steady_wrapper_keeps_its_buffers(stager: Stager) -> None:
    live = WrapperTensor(torch.arange(8.0), {"block": 64})
    for i in range(3):
        live.packed.fill_(i)
        snap = stager.stage({"w": live})["w"]
        assert torch.equal(snap.packed, torch.full((8,), float(i)))
    assert stager.allocations == 1


def test_a_changed_context_gets_new_buffers_never_a_stale_one(stager: Stager) -> None:
    live = WrapperTensor(torch.arange(8.0), {"block": 64})
    stager.stage({"w": live})
    live.meta["block"] = 32  # in place: the plan must not hold the live dict itself
    snap = stager.stage({"w": live})["w"]
    assert stager.allocations == 2 and snap.meta == {"block": 32}
    live.packed = torch.arange(8, dtype=torch.int32)  # an inner tensor of another dtype
    snap = stager.stage({"w": live})["w"]
    assert stager.allocations == 3 and snap.packed.dtype == torch.int32
    assert torch.equal(snap.packed, torch.arange(8, dtype=torch.int32))


def test_a_context_that_cannot_be_compared_gets_new_buffers_at_every_save(stager: Stager) -> None:
    live = WrapperTensor(torch.arange(8.0), _Uncomparable(64))
    for i in range(3):
        live.meta.block = i
        snap = stager.stage({"w": live})["w"]
        assert snap.meta.block == i and snap.meta is not live.meta
    assert stager.allocations == 3


def test_a_wrapper_goes_to_the_writer_process_by_its_place_not_its_bytes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stager = Stager(shared=True)
    try:
        live = WrapperTensor(torch.arange(1 << 20, dtype=torch.float32), {"block": 64})  # 4 MiB
        snap = stager.stage({"w": live})["w"]
        with caplog.at_level(logging.WARNING, logger="safepoint"):
            value = handoff.value_of(snap, stager.arena)
        assert "outside the staging segment" not in caplog.text
        assert len(pickle.dumps(value)) < 4096  # its place and metadata, not its 4 MiB
        back = handoff.materialize_value(value, stager.arena)
        _same_wrapper(back, snap)
        assert back.packed.data_ptr() == snap.packed.data_ptr()  # the segment's own bytes
    finally:
        stager.release()


def test_a_nested_wrapper_and_a_transposed_inner_tensor_are_staged_as_they_are(stager: Stager) -> None:
    inner = WrapperTensor(torch.arange(6.0).reshape(2, 3).t(), {"level": 2})  # strides (1, 3)
    live = WrapperTensor(inner, {"level": 1})
    snap = stager.stage({"w": live})["w"]
    assert type(snap) is WrapperTensor and type(snap.packed) is WrapperTensor
    assert snap.meta == {"level": 1} and snap.packed.meta == {"level": 2}
    assert snap.packed.packed.stride() == (1, 3) and torch.equal(snap.packed.packed, inner.packed)
    inner.packed.mul_(2)
    snap = stager.stage({"w": live})["w"]
    assert stager.allocations == 1 and torch.equal(
        snap.packed.packed, torch.arange(6.0).reshape(2, 3).t() * 2
    )
    if stager.arena is not None:  # the writer process rebuilds both levels over the segment
        back = handoff.materialize_value(handoff.value_of(snap, stager.arena), stager.arena)
        assert type(back.packed) is WrapperTensor and back.packed.meta == {"level": 2}
        assert back.packed.packed.data_ptr() == snap.packed.packed.data_ptr()
        assert back.packed.packed.stride() == (1, 3)


# torchao's NF4Tensor: the real case.


def _nf4() -> Any:
    nf4 = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    return nf4


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_an_nf4_base_saves_async_as_it_saves_sync(
    tmp_path: Path, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    nf4 = _nf4()
    torch.manual_seed(0)
    shapes = {"w0": (2048, 2048), "w1": (256, 512)}  # w0's packed 4-bit data: 2 MiB, over the warning's 1 MiB
    weights = {k: nf4.to_nf4(torch.randn(*shape, dtype=torch.bfloat16)) for k, shape in shapes.items()}
    with caplog.at_level(logging.INFO, logger="safepoint"):
        for name in ("sync", mode):
            state = safepoint.TrainState(model=_Bufs(**weights), rng=False)
            assert _save(tmp_path / name, name, state, steps=3) == (name != "sync")  # one set for 3 saves
    assert "written by the thread" not in caplog.text and "outside the staging segment" not in caplog.text
    want, got = stored(tmp_path / "sync" / "step-3"), stored(tmp_path / mode / "step-3")
    assert want.keys() == got.keys()
    for key, v in want.items():
        assert type(v) is nf4.NF4Tensor and type(got[key]) is nf4.NF4Tensor, key
        _same_wrapper(got[key], v)
    for name in ("sync", mode):
        back = _Bufs(
            **{k: nf4.to_nf4(torch.zeros(*shape, dtype=torch.bfloat16)) for k, shape in shapes.items()}
        )
        with safepoint.CheckpointManager(tmp_path / name) as mgr:
            assert mgr.restore(safepoint.TrainState(model=back, rng=False)) == 3
        for k, w in weights.items():
            b = getattr(back, k)
            assert type(b) is nf4.NF4Tensor
            assert torch.equal(b.quantized_data, w.quantized_data)
            assert torch.equal(b.get_original_weight(), w.get_original_weight())


def test_a_frozen_nf4_base_keeps_one_buffer_set(stager: Stager) -> None:
    nf4 = _nf4()
    weights = {f"w{i}": nf4.to_nf4(torch.randn(128, 256, dtype=torch.bfloat16)) for i in range(3)}
    for _ in range(4):
        snap = stager.stage(dict(weights))
    assert stager.allocations == 1
    for k, w in weights.items():
        assert type(snap[k]) is nf4.NF4Tensor
        assert torch.equal(snap[k].get_original_weight(), w.get_original_weight())
