"""Gathered staging: many small device tensors reach the host in a few large transfers, not one each.

An async save of a state with thousands of small CUDA tensors (a model's biases and norms, a
``ParameterList``, Adam's two moments of each) blocked the loop 1.6-2.4x a pinned copy of the same tensors on
an H100 (docs/benchmarks.md "The GPU path"), and that pinned copy is itself mostly the host's launch cost: one
``cudaMemcpyAsync`` per tensor costs ~5 us whatever its size (9,000 tensors, 512 MiB: 41-66 ms, where the
same bytes in large transfers take ~10 ms at the 51 GB/s measured there). So the small device tensors of a
state are gathered: their staging buffers lie back to back at the start of the pinned staging segment
(``shared_buffers.move_into_arena(first=...)``), and per chunk of at most ``GATHER_CHUNK_BYTES`` the copy is
one same-device ``torch._foreach_copy_`` per dtype into views of one device buffer (a few fused kernels per
chunk, not a launch per tensor) and one device-to-host copy of that buffer onto the chunk's bytes of the
segment.

Each buffer then holds what its own copy would have put there: it is a contiguous tensor of the live
tensor's shape and dtype, and its bytes of the device buffer are a view of that shape at the same offset
from the chunk's start (the ``copy_`` of a non-contiguous or conjugate-bit source is the same either way).
That view has the live tensor's dtype only where CUDA's fused foreach copy moves every bit pattern of it
unchanged (``copy_dtype``): the kernel converts each element to its op type and back, so bf16, fp16 and
float8 would go through float32 (a NaN's payload and sign lost: not what the per-tensor ``cudaMemcpy``
keeps), and it has no kernel for uint16-64, float8_e8m0fnu or complex32 (the save would fail). Those are
copied as the integers of their size, source and view both.

A chunk's transfer covers only packed buffers of this gather and the alignment gaps between them: a packed
buffer that is not gathered (the fingerprint policy changed since the buffers were made) ends the
chunk, so no other buffer's bytes are ever written by it.
"""

from __future__ import annotations

import logging
import operator
import os
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

import torch

from safepoint.save.kinds import plain
from safepoint.save.shared_buffers import PACK_ALIGN, SharedArena
from safepoint.save.stage_plan import Plan, Walked, cuda_devices

log = logging.getLogger("safepoint")

GATHER_DEVICE_TYPES: frozenset[str] = frozenset({"cuda"})
"""The devices whose small tensors are gathered. Not the CPU: there the copy of a small tensor inside one
``torch._foreach_copy_`` costs ~1-1.5 us and gathering would copy every byte twice (flattening 9,000 CPU
tensors first and copying the result measured 1.2-3x slower than the per-tensor foreach copy on this
project's CPU). Tests add "cpu" to run the gathered path where there is no GPU."""

GATHER_MAX_BYTES = 1 << 20
"""Tensors from this size up are copied on their own: a pinned transfer of 1 MiB is ~20 us of bandwidth
against ~5 us of launch, so gathering it would spare little and make the device buffer larger."""

GATHER_CHUNK_BYTES = 16 << 20
"""The most bytes one chunk carries, and so the size of the one device buffer a gather holds while its
buffer set lives (GPU memory taken from the caching allocator once, not per save). 512 MiB of small tensors
is 32 chunks: 32 device-to-host transfers, each near the link's full bandwidth."""


# What CUDA's same-device foreach copy moves bit for bit: its op type is the dtype itself.
_AS_IS = frozenset({torch.float32, torch.float64, torch.complex64, torch.complex128, torch.uint8, torch.int8,
                    torch.int16, torch.int32, torch.int64})  # fmt: skip
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a gathered tensor of ``dtype`` is copied in on the device: its own where the fused copy keeps
    every bit, else the integer of its size (floating, complex32, bool and unsigned dtypes); None: not
    gathered (a quantized or bits dtype)."""
    if dtype in _AS_IS:
        return dtype
    if dtype.is_floating_point or dtype.is_complex or dtype in (torch.bool, torch.uint16, torch.uint32,
                                                                torch.uint64):  # fmt: skip
        return _BITS.get(dtype.itemsize)
    return None


def gatherable(t: torch.Tensor, nbytes: int) -> bool:
    """Whether async staging gathers ``t`` (of ``nbytes``): a non-empty tensor under ``GATHER_MAX_BYTES`` on a
    device of ``GATHER_DEVICE_TYPES`` whose dtype has a ``copy_dtype``, not one it fingerprints
    (``staging.copied_unproven`` says that)."""
    return (
        0 < nbytes < GATHER_MAX_BYTES
        and t.device.type in GATHER_DEVICE_TYPES
        and copy_dtype(t.dtype) is not None
    )


Group = tuple[list[int], list[Any], torch.dtype | None]
"""One batched copy of a chunk: the targets' positions, their views in the device buffer, and the dtype the
live tensors are viewed as first (None: as they are)."""


class _Chunk:
    """One transfer: the device bytes ``dev`` onto the segment's bytes ``host``, after ``groups`` (per copy
    dtype) filled ``dev`` from the live tensors."""

    __slots__ = ("dev", "groups", "host")

    def __init__(self, dev: torch.Tensor, host: torch.Tensor, groups: list[Group]):
        self.dev, self.host, self.groups = dev, host, groups


class Gather:
    """The gathered copy of one plan's small device tensors (``plan_gather``); reused by every save."""

    def __init__(self, chunks: list[_Chunk], members: frozenset[int], device_buffer: torch.Tensor) -> None:
        self.chunks = chunks
        self.members = members
        """The targets' positions it copies: the per-tensor copy leaves them out."""
        self.device_buffer = device_buffer
        """The device memory the chunks go through (kept alive with the gather)."""

    def copy(self, lives: Sequence[torch.Tensor]) -> None:
        """Copy every member's live tensor into its buffer, on the current stream (non_blocking: the caller
        synchronises before the writer reads the buffers, as for the per-tensor copy)."""
        pick = lives.__getitem__
        with torch.no_grad():  # a Parameter source must not make the views part of its autograd graph
            for chunk in self.chunks:
                for positions, views, bits in chunk.groups:
                    sources = list(map(pick, positions))
                    if bits is not None:
                        sources = _as_bits(sources, bits)
                    torch._foreach_copy_(views, sources, non_blocking=True)
                chunk.host.copy_(chunk.dev, non_blocking=True)

    def rekeyed(self, was: Sequence[torch.Tensor], now: Sequence[torch.Tensor]) -> Gather | None:
        """This gather for a plan whose targets ``now`` are ``was`` (this one's) in another order
        (``Plan.rekeyed``: the same buffers, re-paired by key): the same chunks, each member at its new
        position. None where they are not the same buffers."""
        if len(was) != len(now):
            return None
        at = {id(t): k for k, t in enumerate(now)}
        moved = [at.get(id(t), -1) for t in was]
        if -1 in moved:
            return None
        chunks = [
            _Chunk(
                c.dev,
                c.host,
                [([moved[i] for i in positions], views, bits) for positions, views, bits in c.groups],
            )
            for c in self.chunks
        ]
        return Gather(chunks, frozenset(moved[i] for i in self.members), self.device_buffer)


def plan_gather(
    targets: Sequence[torch.Tensor],
    lives: Sequence[torch.Tensor],
    picks: Sequence[int],
    region: SharedArena | None,
) -> Gather | None:
    """The gather of ``picks`` (positions in ``targets``, each ``gatherable`` and copied at every save) whose
    buffers ``region`` packed, or None where fewer than two qualify. Built once per plan and policy.

    A pick qualifies when its buffer is a contiguous tensor over exactly its bytes inside the segment's
    packed part and its live tensor has the buffer's dtype and shape and lies on the same device as the
    first pick's. Chunks are runs of qualifying buffers that lie one right after the other (the next at
    the first multiple of ``PACK_ALIGN`` past the last one's end), at most ``GATHER_CHUNK_BYTES`` long."""
    if region is None or not region.packed or len(picks) < 2:
        return None
    device = lives[picks[0]].device
    placed: list[tuple[int, int, int]] = []  # (offset in the segment, nbytes, position)
    for i in picks:
        target, live = targets[i], lives[i]
        nbytes = target.numel() * target.element_size()
        off = region.offset_of(target.data_ptr(), nbytes)
        if (
            off is None
            or off + nbytes > region.packed
            or live.device != device
            or live.dtype != target.dtype
            or live.shape != target.shape
            or not target.is_contiguous()
            or target.untyped_storage().nbytes() != nbytes
        ):
            continue
        placed.append((off, nbytes, i))
    placed.sort()
    runs: list[list[tuple[int, int, int]]] = []
    for off, nbytes, i in placed:
        run = runs[-1] if runs else None
        if run is not None:
            last_off, last_n, _ = run[-1]
            if off == _aligned(last_off + last_n) and off + nbytes - run[0][0] <= GATHER_CHUNK_BYTES:
                run.append((off, nbytes, i))
                continue
        runs.append([(off, nbytes, i)])
    runs = [run for run in runs if len(run) > 1]  # a lone buffer: its own copy is one transfer already
    if not runs:
        return None
    size = max(run[-1][0] + run[-1][1] - run[0][0] for run in runs)
    try:
        device_buffer = device_memory(size, device)
    except torch.cuda.OutOfMemoryError as e:
        # A job that fills its GPU leaves no room for the chunk buffer: it stages tensor by tensor, as
        # without the gather, rather than failing every save (until the next buffer set tries again).
        log.warning("safepoint: staging tensor by tensor: no %d bytes of %s memory for gathering (%s)",
                    size, device, str(e).splitlines()[0] if str(e) else "out of memory")  # fmt: skip
        return None
    chunks = []
    for run in runs:
        start, end = run[0][0], run[-1][0] + run[-1][1]
        dev = device_buffer[: end - start]
        # Per copy dtype, and apart the sources laid out unlike their views (a transposed weight): on CUDA a
        # foreach copy takes its fused route only when every pair shares sizes and strides, and one odd
        # pair would send the whole list tensor by tensor.
        groups: dict[tuple[torch.dtype, bool, bool], Group] = {}
        for off, nbytes, i in run:
            target = targets[i]
            as_dtype = copy_dtype(target.dtype)
            assert as_dtype is not None  # gatherable
            view = dev[off - start : off - start + nbytes].view(as_dtype).view(target.shape)
            bits = as_dtype if as_dtype != target.dtype else None
            key = (as_dtype, bits is None, lives[i].stride() == view.stride())
            positions, views, _ = groups.setdefault(key, ([], [], bits))
            positions.append(i)
            views.append(view)
        chunks.append(_Chunk(dev, region.bytes_at(start, end - start), list(groups.values())))
    members = frozenset(map(operator.itemgetter(2), (p for run in runs for p in run)))
    return Gather(chunks, members, device_buffer)


def _as_bits(sources: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """``sources`` viewed as ``dtype`` (of their element size): the same memory, any strides."""
    try:
        return list(map(torch.Tensor.view, sources, repeat(dtype)))  # ~1 us a tensor, in the loop's wait
    except RuntimeError:  # a negative-bit or conjugate view has no such view: its values, resolved first
        return [t.resolve_conj().resolve_neg().view(dtype) for t in sources]


def device_memory(nbytes: int, device: torch.device) -> torch.Tensor:
    """The gather's device buffer (its own function: the tests make it fail as a full GPU would)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _aligned(n: int) -> int:
    return -(-n // PACK_ALIGN) * PACK_ALIGN


class Split:
    """``Stager._split``'s answer for one plan and policy: which targets are fingerprinted, which gathered."""

    __slots__ = ("gather", "key", "large", "other_targets", "others", "plan", "small")

    def __init__(self, plan: Plan, key: Any, small: list[int], large: list[int], gather: Gather | None):
        self.plan, self.key, self.small, self.large, self.gather = plan, key, small, large, gather
        members = gather.members if gather is not None else frozenset()
        self.others = [i for i in range(len(plan.targets)) if i not in members]
        """The targets the batched per-tensor copy writes when every target is copied."""
        self.other_targets = [plan.targets[i] for i in self.others]


def gather_picks(walked: Walked, copied: Callable[[torch.Tensor, int], bool]) -> list[int]:
    """The walk's tensor items whose buffers are packed for the gathered copy: plain ones that are
    ``gatherable`` and copied at every save (``copied``), all on one device, ordered by dtype (one batched
    copy per dtype and chunk). Empty where fewer than two qualify, or where a segment cannot be made here."""
    if not hasattr(os, "memfd_create"):
        return []
    skip = set(walked.opaque)
    picks = []
    for i, t in enumerate(walked.leaves):
        if i not in skip and plain(t):
            nbytes = t.numel() * t.element_size()
            if gatherable(t, nbytes) and copied(t, nbytes):
                picks.append(i)
    devices = {walked.leaves[i].device for i in picks}
    if len(picks) < 2 or len(devices) != 1 or len(cuda_devices(walked) - devices) > 0:
        return []
    order: dict[torch.dtype, int] = {}
    for i in picks:
        order.setdefault(walked.leaves[i].dtype, len(order))
    return sorted(picks, key=lambda i: order[walked.leaves[i].dtype])
