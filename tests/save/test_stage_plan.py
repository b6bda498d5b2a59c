"""Async staging's fast path (save/stage_plan.py): one walk per save pairs each tensor with its buffer by
position, and the pairing is reused only while the walk's signature proves the state the same; a state
that changed shape gets new buffers, a tensor replaced by one of the same shape keeps its buffer; every
snapshot equals the live tensors bit for bit; the copy is one batched call; nothing grows across saves."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from safepoint.save import staging
from safepoint.save.staging import Stager
from tests.helpers.forked import alone_in_a_fork

State = dict[str, Any]


@pytest.fixture(autouse=True)
def _fingerprint_every_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """These states' tensors are all smaller than ``FINGERPRINT_CPU_MIN_BYTES``, which staging would copy
    without a fingerprint: with no floor it fingerprints each one and skips those proven unchanged, the
    path that a stale pairing could get wrong (a skipped tensor keeps what its buffer held). The default
    floor is tested in test_staging_skip.py."""
    monkeypatch.setattr(staging, "FINGERPRINT_CPU_MIN_BYTES", 0)


def _state() -> State:
    torch.manual_seed(0)
    tied = torch.randn(16, 8)
    return {
        "w": torch.randn(32, 16),
        "b": torch.randn(16),
        "emb": tied,
        "head": tied,  # tied: one buffer for both keys
        "step": torch.tensor(3.0),
        "lr": 0.1,
        "opt": {"state": {"p0": {"exp_avg": torch.randn(32, 16), "step": torch.tensor(1.0)}}},
        "groups": [{"params": ["p0"], "betas": (0.9, 0.99)}],
        "seq": [torch.randn(3), (torch.randn(2), 4)],
        "t": torch.randn(7, 5).t(),  # non-contiguous
    }


def _leaves(sd: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(sd, dict):
        for k, v in sd.items():
            yield from _leaves(v, f"{path}.{k}")
    elif isinstance(sd, (list, tuple)):
        for i, v in enumerate(sd):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, sd


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().resolve_conj().resolve_neg().reshape(-1).contiguous().view(torch.uint8).tolist())


def assert_snapshot(snapshot: State, sd: State) -> None:
    """The snapshot has the state's structure, every tensor equal bit for bit (NaN payloads included) and
    living in a staging buffer, never the live tensor itself."""
    mine, theirs = list(_leaves(snapshot)), list(_leaves(sd))
    assert [p for p, _ in mine] == [p for p, _ in theirs]
    for (path, got), (_, want) in zip(mine, theirs, strict=True):
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor), path
            assert got is not want and got.dtype == want.dtype and got.shape == want.shape, path
            assert _bits(got) == _bits(want), path
        else:
            assert got == want, path


def _buffers(snapshot: State) -> list[int]:
    return [t.data_ptr() for _, t in _leaves(snapshot) if isinstance(t, torch.Tensor)]


def _set(path: tuple[Any, ...], value: Any) -> Callable[[State], None]:
    def change(sd: State) -> None:
        container = sd
        for k in path[:-1]:
            container = container[k]
        container[path[-1]] = value(container[path[-1]]) if callable(value) else value

    return change


def _del(key: str) -> Callable[[State], None]:
    return lambda sd: sd.pop(key)


# Each changes the state's structure: the buffers no longer fit it, new ones are made.
RESHAPED = {
    "resized": _set(("w",), lambda t: torch.randn(33, 16)),
    "resized-in-place": _set(("b",), lambda t: t.resize_(20).normal_()),
    "dtype": _set(("opt", "state", "p0", "exp_avg"), lambda t: t.double()),
    "key-added": _set(("extra",), torch.ones(4)),
    "key-removed": _del("b"),
    "tensor-for-value": _set(("lr",), torch.tensor(0.1)),
    "value-for-tensor": _set(("step",), 3.0),
    "list-longer": _set(("seq",), lambda s: [*s, torch.zeros(1)]),
    "tie-undone": _set(("head",), lambda t: t.clone().add_(1.0)),
    "tie-made": lambda sd: sd.__setitem__("w", sd["opt"]["state"]["p0"]["exp_avg"]),  # same shape: a tie
}


@pytest.mark.parametrize("change", list(RESHAPED.values()), ids=list(RESHAPED))
def test_a_changed_structure_gets_new_buffers(stager: Stager, change: Callable[[State], None]) -> None:
    sd = _state()
    assert_snapshot(stager.stage(sd), sd)
    change(sd)
    snapshot = stager.stage(sd)
    assert stager.allocations == 2
    assert_snapshot(snapshot, sd)
    with torch.no_grad():  # and the new pairing keeps working
        for _, t in _leaves(sd):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.add_(0.5)
    assert_snapshot(stager.stage(sd), sd)
    assert stager.allocations == 2


def test_a_tie_undone_by_a_conj_view_gets_new_buffers() -> None:
    # Two keys, one complex tensor; then the second key holds its conj view: the same data_ptr, dtype,
    # shape and strides, other values. One buffer for both would stage the wrong values for the view.
    z = torch.randn(4, 3, dtype=torch.complex64)
    sd: State = {"z": z, "zc": z, "r": z.real}
    stager = Stager()
    first = stager.stage(sd)
    assert first["z"] is first["zc"]
    sd["zc"] = z.conj()
    assert (sd["zc"].data_ptr(), sd["zc"].stride()) == (z.data_ptr(), z.stride()) and sd["zc"].is_conj()
    snapshot = stager.stage(sd)
    assert stager.allocations == 2 and snapshot["z"] is not snapshot["zc"]
    assert_snapshot(snapshot, sd)
    sd["zc"] = z  # tied again
    snapshot = stager.stage(sd)
    assert stager.allocations == 3 and snapshot["z"] is snapshot["zc"]
    assert_snapshot(snapshot, sd)


def _swap(sd: State, p0: State) -> None:
    sd["w"], p0["exp_avg"] = p0["exp_avg"], sd["w"]


# Each replaces tensors by others of the same device, dtype and shape: the buffers still fit, item for item.
REPLACED = {
    "replaced": _set(("w",), lambda t: torch.randn_like(t)),
    "replaced-nested": _set(("opt", "state", "p0", "exp_avg"), lambda t: t.clone().mul_(2.0)),
    "strides": _set(("t",), lambda t: t.contiguous()),
    "tie-replaced": lambda sd: (sd.__setitem__("emb", torch.randn(16, 8)), sd.__setitem__("head", sd["emb"])),
    "swapped": lambda sd: _swap(sd, sd["opt"]["state"]["p0"]),  # two tensors trade places
}


@pytest.mark.parametrize("change", list(REPLACED.values()), ids=list(REPLACED))
def test_a_replaced_tensor_keeps_its_buffer_and_is_staged(
    stager: Stager, change: Callable[[State], None]
) -> None:
    sd = _state()
    first = _buffers(stager.stage(sd))
    stager.stage(sd)  # the second staging proves the untouched tensors unchanged: they are skipped next
    change(sd)
    snapshot = stager.stage(sd)
    assert stager.allocations == 1 and _buffers(snapshot) == first
    assert_snapshot(snapshot, sd)
    assert_snapshot(stager.stage(sd), sd)


def _reordered(sd: Any) -> Any:
    """The same state, the same objects, with every dict's keys in reverse order."""
    if isinstance(sd, dict):
        return {k: _reordered(sd[k]) for k in reversed(list(sd))}
    if isinstance(sd, list):
        return [_reordered(v) for v in sd]
    if isinstance(sd, tuple):
        return tuple(_reordered(v) for v in sd)
    return sd


def _buffer_of(snapshot: State) -> dict[str, int]:
    return {p: t.data_ptr() for p, t in _leaves(snapshot) if isinstance(t, torch.Tensor)}


def test_reordered_keys_keep_their_buffers_and_incremental_records(stager: Stager) -> None:
    # A state whose dicts list the same keys in another order (a dict rebuilt in another order each step):
    # the same buffers, paired by key, not a new set at every save; nothing proven unchanged is copied again.
    sd = _state()
    sd["marked"] = torch.randn(3, 2).as_subclass(_Marked)  # copied by torch's function, paired too
    first = _buffer_of(stager.stage(sd))
    stager.stage(sd)
    proven = stager.skipped
    assert proven > 0
    for i in range(4):  # reversed, back, reversed... every save another order
        sd = _reordered(sd)
        snapshot = stager.stage(sd)
        assert stager.allocations == 1 and _buffer_of(snapshot) == first
        assert stager.skipped == proven, i  # the records went with their buffers: nothing copied
        assert_snapshot(snapshot, sd)
    with torch.no_grad():
        sd["w"].add_(1.0)
        sd["head"].mul_(2.0)  # tied: both keys
        sd["opt"]["state"]["p0"]["exp_avg"].data[0, 0] += 1.0  # a write the version counter misses
    sd = _reordered(sd)
    assert_snapshot(stager.stage(sd), sd)
    assert stager.allocations == 1


@pytest.mark.parametrize("change", list(RESHAPED.values()), ids=list(RESHAPED))
def test_reordered_and_changed_in_structure_gets_new_buffers(
    stager: Stager, change: Callable[[State], None]
) -> None:
    sd = _state()
    stager.stage(sd)
    stager.stage(sd)
    sd = _reordered(sd)
    change(sd)
    assert_snapshot(stager.stage(sd), sd)
    assert stager.allocations == 2


@pytest.mark.parametrize("change", list(REPLACED.values()), ids=list(REPLACED))
def test_reordered_and_replaced_keeps_its_buffers_and_is_staged(
    stager: Stager, change: Callable[[State], None]
) -> None:
    sd = _state()
    first = _buffer_of(stager.stage(sd))
    stager.stage(sd)
    sd = _reordered(sd)
    change(sd)
    snapshot = stager.stage(sd)
    assert stager.allocations == 1 and _buffer_of(snapshot) == first
    assert_snapshot(snapshot, sd)
    assert_snapshot(stager.stage(sd), sd)


def test_reordered_keys_whose_values_traded_places_never_reuse_a_stale_pairing(stager: Stager) -> None:
    # Keys reordered and their tensors swapped: each key path now holds another shape (new buffers) or
    # another tensor of the same shape (the same buffers, its bytes staged afresh), never the old pairing.
    a, b, c = torch.randn(3), torch.randn(4), torch.randn(4)
    stager.stage({"a": a, "b": b, "c": c, "n": {"x": a.clone(), "y": 1.0}})
    snapshot = stager.stage({"c": b, "b": c, "a": a, "n": {"y": 1.0, "x": a.clone()}})
    assert stager.allocations == 1
    assert torch.equal(snapshot["c"], b) and torch.equal(snapshot["b"], c)
    sd: State = {"b": a, "a": b, "c": c, "n": {"y": 1.0, "x": a}}  # "a" and "b" now other shapes
    assert_snapshot(stager.stage(sd), sd)
    assert stager.allocations == 2
    sd = {"b": a, "a": b, "c": c, "n": {"y": torch.ones(1), "x": a}}  # a value for a tensor's key path
    sd2 = {"b": a, "a": b, "c": c, "n": {"x": 1.0, "y": a}}
    assert_snapshot(stager.stage(sd2), sd2)
    assert stager.allocations == 3
    assert_snapshot(stager.stage(sd), sd)
    assert stager.allocations == 4


def test_a_reordered_tie_keeps_one_buffer_and_a_reordered_conj_view_gets_its_own() -> None:
    z = torch.randn(4, 3, dtype=torch.complex64)
    stager = Stager()
    first = stager.stage({"z": z, "zc": z, "r": z.real})
    snapshot = stager.stage({"r": z.real, "zc": z, "z": z})
    assert stager.allocations == 1 and snapshot["z"] is snapshot["zc"] is first["z"]
    sd: State = {"r": z.real, "zc": z.conj(), "z": z}  # reordered, and the tie undone by a conj view
    snapshot = stager.stage(sd)
    assert stager.allocations == 2 and snapshot["z"] is not snapshot["zc"]
    assert_snapshot(snapshot, sd)


def test_a_replaced_tensor_with_the_same_bytes_is_proven_and_skipped() -> None:
    # Its version counter is another tensor's: the replacement is fingerprinted, never trusted by counter.
    sd = _state()
    stager = Stager()
    stager.stage(sd)
    stager.stage(sd)
    sd["w"] = sd["w"].clone()
    with torch.no_grad():
        sd["b"] = sd["b"].clone().add_(1.0)  # another tensor, another version count, other bytes
    snapshot = stager.stage(sd)
    assert stager.allocations == 1
    assert sd["w"].nbytes <= stager.skipped
    assert_snapshot(snapshot, sd)


def test_snapshots_equal_the_live_tensors_bit_for_bit_across_updates() -> None:
    sd = _state()
    stager = Stager()
    g = torch.Generator().manual_seed(1)
    tensors = [t for _, t in _leaves(sd) if isinstance(t, torch.Tensor)]
    for _ in range(12):
        with torch.no_grad():
            for i, t in enumerate(tensors):
                pick = int(torch.randint(0, 4, (), generator=g))
                if pick == 1:
                    t.add_(torch.randn(t.shape, generator=g))  # the version counter moves
                elif pick == 2:
                    t.data[(0,) * t.dim()] = float("nan")  # a write the version counter misses
                elif pick == 3:
                    t.data.view(torch.int32)[(-1,) * t.dim()] ^= 1 << (i % 31)  # one bit, missed too
        assert_snapshot(stager.stage(sd), sd)
    assert stager.allocations == 1


class _Ops(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_copy_is_one_batched_call() -> None:
    # One torch._foreach_copy_ for all the tensors to copy, not one copy_ launched per tensor (per-tensor
    # Python work is what made staging 3-20x a plain copy with thousands of tensors, issue 27).
    sd = {f"p{i}": torch.randn(4) for i in range(50)}
    stager = Stager()
    stager.stage(sd)
    with torch.no_grad():
        for t in sd.values():
            t.add_(1.0)
    with _Ops() as ops:
        stager.stage(sd)
    copies = [op for op in ops.seen if "copy" in op]
    assert copies == ["aten._foreach_copy_.default"], ops.seen


@pytest.mark.parametrize("reorder", [False, True], ids=["same-order", "reordered"])
def test_no_growth_and_no_cyclic_garbage_across_saves(stager: Stager, reorder: bool) -> None:
    sd = _state()
    stager.stage(sd)
    buffers = _buffers(stager.stage(sd))

    def twenty_saves() -> str:
        state = sd
        gc.collect()
        gc.disable()
        before = len(gc.get_objects())
        for _ in range(20):
            if reorder:  # re-paired by key at every save (an even count: the first order at the end)
                state = _reordered(state)
            with torch.no_grad():
                state["w"].add_(1.0)
            snapshot = stager.stage(state)
        del snapshot
        # Everything a staging made and no longer needs goes by reference count: no cycle for the
        # collector to find later (inside a later save's blocking time), and nothing kept per save.
        found = gc.collect()
        grown = len(gc.get_objects()) - before
        same = stager.allocations == 1 and _buffers(stager.stage(state)) == buffers
        return f"cyclic garbage {found}, objects grown {grown}, buffers reused {same}"

    answer = alone_in_a_fork(twenty_saves)
    found, grown, same = (part.rsplit(" ", 1)[1] for part in answer.split(", "))
    assert found == "0", answer
    assert int(grown) < 100, answer
    assert same == "True", answer


def test_dtensors_are_staged_and_a_changed_placement_gets_new_buffers(one_rank_group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    sd: State = {"a": distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)]), "b": torch.randn(3)}
    stager = Stager()
    for _ in range(3):
        with torch.no_grad():
            sd["a"].to_local().add_(1.0)
        snapshot = stager.stage(sd)
        assert isinstance(snapshot["a"], DTensor) and snapshot["a"].placements == (Shard(0),)
        assert torch.equal(snapshot["a"].to_local(), sd["a"].to_local())
        assert snapshot["a"].to_local().data_ptr() != sd["a"].to_local().data_ptr()
    assert stager.allocations == 1
    sd = {"b": sd["b"], "a": sd["a"]}  # reordered: the DTensor keeps its buffer
    snapshot = stager.stage(sd)
    assert stager.allocations == 1 and torch.equal(snapshot["a"].to_local(), sd["a"].to_local())
    sd["a"] = distribute_tensor(sd["a"].full_tensor(), mesh, [Replicate()])  # same local shape, new layout
    snapshot = stager.stage(sd)
    assert stager.allocations == 2 and snapshot["a"].placements == (Replicate(),)
    assert torch.equal(snapshot["a"].to_local(), sd["a"].to_local())


class _Marked(torch.Tensor):
    """A tensor subclass (as quantization and FP8 libraries make): copied by torch's own function."""


def test_a_tensor_subclass_is_staged_by_torchs_copy_and_refreshed_every_save() -> None:
    sd: State = {"plain": torch.randn(5), "marked": torch.randn(4, 3).as_subclass(_Marked)}
    stager = Stager()
    for _ in range(3):
        with torch.no_grad():
            sd["marked"].add_(1.0)
            sd["plain"].add_(1.0)
        snapshot = stager.stage(sd)
        assert torch.equal(torch.Tensor(snapshot["marked"]), torch.Tensor(sd["marked"]))
        assert snapshot["marked"].data_ptr() != sd["marked"].data_ptr()
        assert torch.equal(snapshot["plain"], sd["plain"])
    assert stager.allocations == 1
    sd["marked"] = torch.randn(4, 4).as_subclass(_Marked)  # another shape: new buffers
    assert torch.equal(torch.Tensor(stager.stage(sd)["marked"]), torch.Tensor(sd["marked"]))
    assert stager.allocations == 2


def test_a_copy_that_failed_part_way_is_not_trusted_by_the_next_save(monkeypatch: pytest.MonkeyPatch) -> None:
    # The fingerprint of a changed tensor is taken before the batched copy: if that copy fails, the buffer
    # must not be taken for holding those bytes (the next save would skip the tensor, staging stale bytes).
    from safepoint.save import staging

    sd: State = {"a": torch.randn(100), "b": torch.randn(100)}
    stager = Stager()
    stager.stage(sd)
    stager.stage(sd)  # both proven unchanged
    sd["a"].data[0] += 1.0  # a write the version counter misses: fingerprinted, found changed, copied...
    real = staging._copy_all

    def failing(targets: list[torch.Tensor], lives: list[torch.Tensor]) -> None:
        raise RuntimeError("copy failed")  # ... but the copy fails

    monkeypatch.setattr(staging, "_copy_all", failing)
    with pytest.raises(RuntimeError, match="copy failed"):
        stager.stage(sd)
    monkeypatch.setattr(staging, "_copy_all", real)
    snapshot = stager.stage(sd)
    assert torch.equal(snapshot["a"], sd["a"]) and torch.equal(snapshot["b"], sd["b"])


@pytest.mark.parametrize("shared", [False, True], ids=["thread", "shared"])
def test_the_old_buffers_are_freed_before_a_new_set_is_allocated(shared: bool) -> None:
    """A state that changed shape never has two buffer sets alive at once (pinned ones are resident)."""
    import weakref

    alive: list[bool] = []
    refs: list[weakref.ref[torch.Tensor]] = []

    def before_alloc() -> None:
        gc.collect()
        alive.extend(r() is not None for r in refs)

    stager = Stager(shared=shared, before_alloc=before_alloc)
    try:
        sd: dict[str, Any] = {"w": torch.randn(256, 256)}
        snap = stager.stage(sd)
        refs.append(weakref.ref(snap["w"]))
        del snap  # the writer is done with it
        sd["w"] = torch.randn(512, 256)  # the state changed shape: new buffers
        stager.stage(sd)
        assert alive == [False], alive  # checked at the second allocation: the old buffer is gone
        assert stager.allocations == 2
    finally:
        stager.release()


def test_an_inference_tensor_is_fingerprinted_not_trusted_by_a_version_counter() -> None:
    """A tensor made under ``torch.inference_mode`` has no version counter (``t._version`` raises): staging
    fingerprints it every save instead, and each snapshot holds its value at that save."""
    with torch.inference_mode():
        ema = torch.randn(256, 256)
    stager = Stager()
    w = torch.ones(3)
    skipped = []
    try:
        for change in (True, False, True):
            if change:
                with torch.inference_mode():
                    ema.add_(1.0)
            snap = stager.stage({"ema": ema, "w": w})
            assert torch.equal(snap["ema"], ema)
            skipped.append(stager.skipped)
        # The first save copies both; unchanged, ema is proven so and skipped; changed, it is copied.
        assert skipped == [0, ema.nbytes + w.nbytes, w.nbytes]
    finally:
        stager.release()
