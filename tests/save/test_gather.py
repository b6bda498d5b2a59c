"""Gathered staging (save/gather.py): many small device tensors reach their buffers through a few large
transfers. The path is for CUDA tensors; here it runs on the CPU (the ``gather_on_cpu`` fixture), which
exercises everything but the device: the packed layout, the chunks, the per-dtype copies, which buffers a
chunk may write, a policy change, and async saves through both writers. tests/gpu/test_cuda.py runs it on a
GPU."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest
import torch
from torch import nn

import safepoint
from safepoint.save import gather, staging
from safepoint.save.shared_buffers import ALIGN, PACK_ALIGN, move_into_arena
from safepoint.save.staging import Stager
from tests.helpers.forked import alone_in_a_fork
from tests.helpers.staging_check import check_mixed_state_staging, check_odd_bits_staging

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the packed segment needs memfd")


@pytest.mark.parametrize("shared", [False, True], ids=["thread", "process"])
def test_a_mixed_state_is_gathered_and_staged_bit_for_bit(gather_on_cpu: None, shared: bool) -> None:
    check_mixed_state_staging(torch.device("cpu"), shared, gathered=True)


def test_the_cpu_is_not_gathered_by_default(stager: Stager) -> None:
    # On the CPU the per-tensor copy is already cheap (gather.GATHER_DEVICE_TYPES): the thread writer's
    # buffers stay torch's own, not a segment, and nothing goes through chunks.
    sd = {f"t{i}": torch.randn(16) for i in range(50)}
    for _ in range(2):
        stager.stage(sd)
        assert stager.gathered == 0
    assert (stager._region is not None) == (stager.arena is not None)


def _adjacent_runs(stager: Stager) -> list[gather._Chunk]:
    split = stager._small
    assert split is not None and split.gather is not None
    return split.gather.chunks


def test_a_packed_buffer_left_out_of_the_gather_is_never_written_by_a_chunk(
    gather_on_cpu: None, stager: Stager, monkeypatch: pytest.MonkeyPatch
) -> None:
    # All 90 tensors are small when the buffers are made, so all are packed side by side. Then the
    # fingerprint floor drops under the 8 KiB ones: staging proves those unchanged and skips their copy,
    # so they are no longer gathered, and a chunk that spanned one would write the device buffer's
    # bytes there (never filled for it): the chunks must end at each of them.
    torch.manual_seed(0)
    sizes = [256, 256, 2048] * 30  # fp32: 1, 1 and 8 KiB
    sd = {f"t{i}": torch.randn(n) for i, n in enumerate(sizes)}
    stager.stage(sd)
    assert stager.gathered == 90
    monkeypatch.setattr(staging, "FINGERPRINT_CPU_MIN_BYTES", 4096)
    for save in range(3):
        with torch.no_grad():
            for i, t in enumerate(sd.values()):
                if sizes[i] == 256:
                    t.add_(1.0)
        snapshot = stager.stage(sd)
        for k, t in sd.items():
            assert torch.equal(snapshot[k], t), (save, k)
        assert stager.gathered == 60
        assert len(_adjacent_runs(stager)) == 30  # the pairs of 1 KiB ones: each 8 KiB one ends a chunk
    assert stager.skipped == 30 * 8192  # the last save proved the 8 KiB ones unchanged: not copied
    assert stager.allocations == 1


def test_chunks_stay_within_the_chunk_size_and_reuse_one_device_buffer(
    gather_on_cpu: None, stager: Stager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gather, "GATHER_CHUNK_BYTES", 4096)
    torch.manual_seed(0)
    sd = {"w": [torch.randn(250) for _ in range(40)], "steps": [torch.tensor(float(i)) for i in range(40)]}
    buffers = set()
    for _ in range(3):
        with torch.no_grad():
            for t in [*sd["w"], *sd["steps"]]:
                t.add_(1.0)
        snapshot = stager.stage(sd)
        for a, b in zip(sd["w"] + sd["steps"], snapshot["w"] + snapshot["steps"], strict=True):
            assert torch.equal(a, b)
        chunks = _adjacent_runs(stager)
        assert len(chunks) > 10 and all(c.dev.numel() <= 4096 for c in chunks)
        assert stager._small is not None and stager._small.gather is not None
        buffers.add(id(stager._small.gather.device_buffer))
        assert stager.gathered == 80
    assert len(buffers) == 1  # made once per buffer set, not per save


def test_packing_lays_the_first_tensors_side_by_side_and_nothing_else_among_them() -> None:
    first = [torch.empty(n) for n in (3, 1, 5)] + [torch.empty(2, dtype=torch.float64)]
    rest = [torch.empty(7), torch.empty(0), torch.tensor(1.0)]
    arena = move_into_arena(first + rest, pin=False, first=first)
    try:
        offsets = [t.data_ptr() - arena.base_ptr for t in first]
        assert offsets == [0, 16, 32, 64]  # each at the next multiple of PACK_ALIGN
        assert arena.packed == 80 and PACK_ALIGN == 16
        after = [t.data_ptr() - arena.base_ptr for t in rest if t.numel()]
        assert all(off >= arena.packed and off % ALIGN == 0 for off in after)
    finally:
        arena.release()


class Many(nn.Module):
    """A model of many small parameters (a ParameterList), as issue 27's 9,000-tensor state, shrunk."""

    def __init__(self) -> None:
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(8, 8)) for _ in range(120))
        self.register_buffer("flags", torch.zeros(10, dtype=torch.bool))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for p in self.ps:
            x = torch.tanh(x @ p)
        return x


def _train(model: Many, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.flags.logical_not_()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_gathered_async_saves_resume_bit_for_bit(gather_on_cpu: None, root: Path, writer: str) -> None:
    torch.manual_seed(0)
    model = Many()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = safepoint.TrainState(model=model, optimizer=opt)
    opts = safepoint.WriterOptions(async_writer=writer)
    with safepoint.CheckpointManager(root, async_save=True, writer=opts) as mgr:
        for step in (1, 2, 3):
            _train(model, opt, 1)
            mgr.save(step, state)  # the next step runs while the save is written
            assert mgr._stager.gathered >= 3 * 120, mgr._stager.gathered
        after = _train(model, opt, 3)
        mgr.wait()
    final = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    model2 = Many()
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(model=model2, optimizer=opt2)) == 3
    assert _train(model2, opt2, 3) == after
    for k, v in model2.state_dict().items():
        assert torch.equal(v, final[k]), k


def test_a_source_laid_out_unlike_its_buffer_is_copied_apart_from_the_others(
    gather_on_cpu: None, stager: Stager
) -> None:
    # On CUDA one foreach call takes its fused route only if every (view, source) pair shares sizes and
    # strides: a transposed weight among contiguous ones goes in a call of its own, so the others keep it.
    torch.manual_seed(0)
    sd = {"w": [torch.randn(8, 8) for _ in range(5)], "t": torch.randn(8, 4).t(), "h": torch.randn(3).half()}
    for _ in range(2):
        with torch.no_grad():
            for t in [*sd["w"], sd["t"], sd["h"]]:
                t.add_(1.0)
        snapshot = stager.stage(sd)
        assert torch.equal(snapshot["t"], sd["t"]) and torch.equal(snapshot["h"], sd["h"])
        assert all(torch.equal(a, b) for a, b in zip(snapshot["w"], sd["w"], strict=True))
    (chunk,) = _adjacent_runs(stager)
    assert sorted(len(positions) for positions, *_ in chunk.groups) == [1, 1, 5]


# What CUDA's same-device ``torch._foreach_copy_`` moves bit for bit: its fused kernel loads each element,
# converts it to the dtype's op type and back (bf16, fp16 and float8 through float32: a NaN's payload and
# sign are not kept) and dispatches only these and those (no uint16-64, float8_e8m0fnu, complex32).
BIT_EXACT_ON_CUDA = {torch.float32, torch.float64, torch.complex64, torch.complex128, torch.uint8, torch.int8,
                     torch.int16, torch.int32, torch.int64}  # fmt: skip


@pytest.mark.parametrize("shared", [False, True], ids=["thread", "process"])
def test_odd_bit_patterns_and_dtypes_are_gathered_bit_for_bit(gather_on_cpu: None, shared: bool) -> None:
    # NaNs with a payload or a sign, bool bytes other than 0 and 1, unsigned and float8 scale dtypes, a
    # negative-bit view: each snapshot holds the live bits, and every chunk's batched copy runs in a dtype
    # that CUDA's fused copy moves unchanged (the CPU's copy is exact whatever the dtype: the dtypes the
    # chunks copy in are what a GPU would get; tests/gpu/test_cuda.py runs the same state there).
    def each(stager: Stager) -> None:
        assert stager.gathered == 24, stager.gathered
        for chunk in _adjacent_runs(stager):
            for _, views, *_ in chunk.groups:
                assert {v.dtype for v in views} <= BIT_EXACT_ON_CUDA, {v.dtype for v in views}

    check_odd_bits_staging(torch.device("cpu"), shared, each)


def test_the_thread_writer_stages_tensor_by_tensor_where_no_segment_can_be_made(gather_on_cpu: None) -> None:
    # The gather only makes staging faster, and the thread writer's buffers need no segment otherwise: where
    # none can be made (here no file descriptor is left, as for a job at its open-file limit; on a GPU, a
    # segment the driver cannot pin), its saves still stage, tensor by tensor, into buffers of their own.
    # In a forked child: the worker's other threads must not meet the exhausted limit.
    def exhausted() -> str:
        sd = {f"t{i}": torch.randn(16) for i in range(20)}
        stager = Stager()
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, hard))
        held = []
        while True:  # every descriptor number under the limit taken
            try:
                held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        _saves_not_gathered(stager, sd)
        assert stager._region is None and stager.allocations == 1
        return "staged"

    assert alone_in_a_fork(exhausted) == "staged"


def test_a_state_whose_keys_come_in_another_order_keeps_its_gather(
    gather_on_cpu: None, stager: Stager
) -> None:
    # Plan.rekeyed re-pairs the same buffers by key when a dict lists its keys in another order (a new
    # plan, the same buffers): the gather goes with them, re-paired too, not built again per reordered save
    # (its views and checks are Python work per tensor: ~25 us each here, more than the copy it spares).
    torch.manual_seed(0)
    base = {f"t{i}": torch.randn(8 + i % 5) for i in range(60)}
    base["h"] = torch.randn(4).half()
    orders = [
        base,
        dict(reversed(list(base.items()))),
        dict(sorted(base.items(), key=lambda kv: kv[1].numel())),
    ]
    stager.stage(base)
    split = stager._small
    assert split is not None and split.gather is not None
    device_buffer = split.gather.device_buffer
    for save in range(6):
        sd = orders[save % 3]
        with torch.no_grad():
            for t in sd.values():
                t.add_(1.0)
        snapshot = stager.stage(sd)
        assert list(snapshot) == list(sd)
        for k, t in sd.items():
            assert torch.equal(snapshot[k], t), (save, k)
        assert stager.gathered == 61
        assert stager._small is not None and stager._small.gather is not None
        assert stager._small.gather.device_buffer is device_buffer, save
    assert stager.allocations == 1


def test_a_device_without_room_for_the_chunk_buffer_stages_tensor_by_tensor(
    gather_on_cpu: None, stager: Stager, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A job that fills its GPU has no 16 MiB left for the gather's device buffer: its saves must still
    # stage (tensor by tensor, as without the gather), not fail. A full GPU cannot be had here, so the
    # allocation fails as CUDA's does; tests/gpu/test_cuda.py fills a real one.
    def full(nbytes: int, device: torch.device) -> torch.Tensor:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 MiB")

    monkeypatch.setattr(gather, "device_memory", full)
    _saves_not_gathered(stager, {f"t{i}": torch.randn(16) for i in range(20)})
    assert "no 1280 bytes of cpu memory for gathering (CUDA out of memory." in caplog.text


def test_a_full_device_is_asked_once_per_buffer_set_even_as_keys_change_order(
    gather_on_cpu: None, stager: Stager, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A reordered state gets a new plan over the same buffers (Plan.rekeyed). Where the device had no room
    # for the chunk buffer, that plan must not ask again at every reordered save: on CUDA each failed
    # allocation first empties the caching allocator's free blocks (the loop's next allocations then go
    # back to cudaMalloc) and logs the warning again.
    asked = []

    def full(nbytes: int, device: torch.device) -> torch.Tensor:
        asked.append(nbytes)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 MiB")

    monkeypatch.setattr(gather, "device_memory", full)
    base = {f"t{i}": torch.randn(16) for i in range(20)}
    orders = [base, dict(reversed(list(base.items())))]
    for save in range(6):
        sd = orders[save % 2]
        snapshot = stager.stage(sd)
        assert all(torch.equal(snapshot[k], t) for k, t in sd.items()) and stager.gathered == 0
    assert len(asked) == 1 and caplog.text.count("for gathering") == 1
    assert stager.allocations == 1


def _saves_not_gathered(stager: Stager, sd: dict[str, torch.Tensor]) -> None:
    """Three saves, every tensor written before each: each snapshot exact, nothing through the gather."""
    for _ in range(3):
        with torch.no_grad():
            for t in sd.values():
                t.add_(1.0)
        snapshot = stager.stage(sd)
        for k, t in sd.items():
            assert torch.equal(snapshot[k], t), k
        assert stager.gathered == 0
