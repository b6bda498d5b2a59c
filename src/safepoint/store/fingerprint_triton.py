"""The content fingerprint's lane sums in one fused Triton kernel (issues 26, 27).

store/fingerprint.py specifies the fingerprint and computes it with ~40 elementwise int64 torch ops per
word: each op reads and writes the whole chunk, ~70 ms per GiB on an H100, 3.7x slower than the pinned
device-to-host copy an unchanged tensor would spare. This kernel reads each word once and keeps every
intermediate in registers, so it is bounded by memory bandwidth, not by ~40 passes over it.

It computes exactly the lane sums of ``fingerprint._piece_sums``: the same position keys (the word's index
within its own tensor), the same fmix constants (store/fingerprint_spec.py), uint64 arithmetic so shifts are
logical and products and sums wrap mod 2**64, and the same zero padding of a tail shorter than a word. So
the digest is bit-identical to the torch ops' and to the CPU's; store/fingerprint.py checks that on each
device before it uses the kernel (``fingerprint.fast_path``), and tests/store/test_fingerprint_triton.py
checks it in Triton's interpreter on the CPU.

The work is laid out like the torch path's chunks: tensors are cut into pieces of at most
``LAUNCH_BYTES``, and pieces are packed into launches of about ``LAUNCH_BYTES``, so thousands of small
tensors cost one launch, not one each. Each launch gets a table built on the host: per piece (address,
first word's index within its tensor, whole words, tail bytes, first tile, last tile), and per tile of
``BLOCK`` words its piece. A program reads one tile straight from the tensor's memory (no gathering copy,
no positions tensor: both are derived from the piece's row), mixes it, and writes its two partial sums.
The partial sums are then summed per piece by differences of a running sum: integer, wrapping, the same on
every run (no atomics, no order dependence). Only 16 bytes per piece come back to the host.

This module imports Triton at import time; store/fingerprint.py imports it lazily, only for a CUDA tensor,
and falls back to the torch ops when it does not import or the kernel fails to compile or to match.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from safepoint.store.fingerprint_spec import FMIX_A, FMIX_B, GOLDEN, KEY_SEED, LANE_B

BLOCK = 1024
"""Words per tile (8 KiB): one program's share. A power of two (``tl.arange``); small enough that a 1 KiB
tensor wastes little, big enough that the per-tile table and sums are ~0.4% of the bytes read."""
LAUNCH_BYTES = 1 << 30
"""Bytes per launch (and at most per piece). Unlike the torch path's ``CHUNK_BYTES``, which bounds ~5x its
size of device scratch, a launch here needs only its tables (~1/500 of its bytes), so launches are large:
each costs tens of microseconds of host time, about what a 32 MiB tile range takes the GPU to read."""
_ROW = 6  # int64 fields per piece in the launch table (below)
_ALIGN = 8  # the kernel reads whole 8-byte words: a misaligned one faults on the GPU

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Triton's interpreter runs the kernel on the host (``TRITON_INTERPRET=1`` set before Triton is
imported): then it reads CPU tensors, which is how tests check it without a GPU."""


@triton.jit
def _lanes_kernel(
    # int64 (pieces, ROW): address, first position, whole words, tail bytes, first tile, last tile
    table: tl.tensor,
    tile_piece: tl.tensor,  # int32 (tiles,): each tile's piece
    out: tl.tensor,  # int64 (tiles, 2): each tile's partial lane sums A and B (the uint64 bits)
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    GOLDEN: tl.constexpr,
    KEY_SEED: tl.constexpr,
    LANE_B: tl.constexpr,
    A1: tl.constexpr,
    A2: tl.constexpr,
    A3: tl.constexpr,
    A4: tl.constexpr,
    A5: tl.constexpr,
    B1: tl.constexpr,
    B2: tl.constexpr,
    B3: tl.constexpr,
    B4: tl.constexpr,
    B5: tl.constexpr,
) -> None:
    tile = tl.program_id(0).to(tl.int64)
    row = table + tl.load(tile_piece + tile).to(tl.int64) * ROW
    addr = tl.load(row)
    pos0 = tl.load(row + 1)  # the piece's first word: its index within its tensor (the position key)
    full = tl.load(row + 2)  # whole words in the piece
    tail = tl.load(row + 3)  # bytes of its last, partial word (0-7): zero-padded, as the torch path pads
    first = (tile - tl.load(row + 4)) * BLOCK  # this tile's first word within the piece
    idx = first + tl.arange(0, BLOCK)
    # The host made every piece 8-byte aligned (a copy of any that was not). Triton 3.6 issues one
    # coalesced 8-byte load per lane (a warp reads 256 contiguous bytes per instruction).
    words = addr.to(tl.pointer_type(tl.uint64))
    w = tl.load(words + idx, mask=idx < full, other=0)
    # The partial word, little-endian from its bytes; only the tile holding index ``full`` reads them.
    j = tl.arange(0, 8)
    here = (first <= full) & (full < first + BLOCK)
    raw = tl.load(addr.to(tl.pointer_type(tl.uint8)) + full * 8 + j, mask=(j < tail) & here, other=0)
    last = tl.sum(raw.to(tl.uint64) << (j * 8).to(tl.uint64), axis=0)
    w = tl.where(idx == full, last, w)
    count = full + (tail > 0).to(tl.int64)
    # The three mixes, written out: fmix_a on the position, on the keyed word (lane A), fmix_b on the word
    # keyed the other way (lane B). In uint64 ``>>`` is a logical shift (the torch path masks its arithmetic
    # one to the same result) and ``*`` wraps mod 2**64. (Inline, not a @jit helper: the interpreter makes
    # each helper call cost milliseconds; compiled, they are the same code.)
    x = (pos0 + idx).to(tl.uint64) * GOLDEN + KEY_SEED
    x = (x ^ (x >> A1)) * A2
    x = (x ^ (x >> A3)) * A4
    key = x ^ (x >> A5)
    x = w ^ key
    x = (x ^ (x >> A1)) * A2
    x = (x ^ (x >> A3)) * A4
    a = x ^ (x >> A5)
    x = w + key * LANE_B
    x = (x ^ (x >> B1)) * B2
    x = (x ^ (x >> B3)) * B4
    b = x ^ (x >> B5)
    valid = idx < count
    zero = tl.zeros([BLOCK], dtype=tl.uint64)
    sum_a = tl.sum(tl.where(valid, a, zero), axis=0)
    sum_b = tl.sum(tl.where(valid, b, zero), axis=0)
    tl.store(out + tile * 2, sum_a.to(tl.int64, bitcast=True))
    tl.store(out + tile * 2 + 1, sum_b.to(tl.int64, bitcast=True))


def usable_on(device: torch.device) -> bool:
    """Whether the kernel can read tensors on ``device``: compiled, a CUDA device; interpreted, the CPU."""
    return device.type == "cpu" if INTERPRETED else device.type == "cuda"


def device_sums(
    device: torch.device, members: list[tuple[int, torch.Tensor]], launch_bytes: int | None = None
) -> list[tuple[list[int], list[list[int]]]]:
    """Like ``fingerprint._device_sums``: every launch's (owner per piece, [A, B] per piece), for the flat
    uint8 views ``members`` (owner, bytes) on ``device``; one device-to-host copy for all of them.
    ``launch_bytes``: a multiple of 8, ``LAUNCH_BYTES`` by default (smaller in tests and the probe)."""
    size_cap = LAUNCH_BYTES if launch_bytes is None else launch_bytes
    if size_cap <= 0 or size_cap % 8:
        raise ValueError(f"launch_bytes must be a positive multiple of 8, not {size_cap}")
    if not usable_on(device):
        raise ValueError(f"the Triton fingerprint kernel cannot read {device} memory here")
    pending: list[tuple[list[int], torch.Tensor]] = []
    keep: list[torch.Tensor] = []  # the tensors the tables point into: alive until the sums are on the host
    rows: list[tuple[int, int, int, int]] = []  # per piece: address, first position, whole words, tail
    owners: list[int] = []
    filled = 0

    def launch() -> None:
        nonlocal filled
        if rows:
            pending.append((list(owners), _launch(device, rows)))
        rows.clear()
        owners.clear()
        filled = 0

    for owner, data in members:
        if data.device != device or data.dtype != torch.uint8 or data.dim() != 1 or data.stride(0) != 1:
            raise ValueError("device_sums takes flat, contiguous uint8 views on its device")
        if data.data_ptr() % _ALIGN:
            data = data.clone()  # a view at an odd offset: an aligned copy (rare: parameters never are)
        keep.append(data)
        total = data.numel()
        base = data.data_ptr()
        for start in range(0, total, size_cap):  # a multiple of 8: pieces stay word-aligned
            size = min(size_cap, total - start)
            rows.append((base + start, start // 8, size // 8, size % 8))
            owners.append(owner)
            filled += size
            if filled >= size_cap:
                launch()
    launch()
    if not pending:
        return []
    host = torch.cat([s for _, s in pending]).cpu().tolist()  # the one device-to-host copy
    del keep
    out, at = [], 0
    for who, sums in pending:
        out.append((who, host[at : at + len(who)]))
        at += len(sums)
    return out


def _launch(device: torch.device, rows: list[tuple[int, int, int, int]]) -> torch.Tensor:
    """(pieces, 2) int64 on ``device``: lanes A and B of each piece of ``rows``, in one kernel launch."""
    n = len(rows)
    table = torch.empty((n, _ROW), dtype=torch.int64)
    table[:, :4] = torch.tensor(rows, dtype=torch.int64)
    words = table[:, 2] + (table[:, 3] > 0)
    tiles = (words + BLOCK - 1) // BLOCK
    ends = torch.cumsum(tiles, 0)
    table[:, 4] = ends - tiles
    table[:, 5] = ends - 1
    total = int(ends[-1])
    tile_piece = torch.repeat_interleave(torch.arange(n, dtype=torch.int32), tiles, output_size=total)
    # One host-to-device copy for both tables: the tiles' int32 column packed after the pieces' rows.
    packed = torch.zeros(n * _ROW + (total + 1) // 2, dtype=torch.int64)
    packed[: n * _ROW] = table.reshape(-1)
    packed[n * _ROW :].view(torch.int32)[:total] = tile_piece
    on_device = packed.to(device)
    table_d = on_device[: n * _ROW]
    out = torch.empty((total, 2), dtype=torch.int64, device=device)
    # Triton launches on the current device (and its current stream): make it the tensors' device.
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _run(table_d, on_device[n * _ROW :].view(torch.int32), out, total)
    # Per piece, by differences of the running sum at each piece's last tile (int64 wraps mod 2**64). Each
    # lane is scanned as its own contiguous 1-D tensor: torch scans a dimension that is not the innermost
    # one with a thread per column, serially, and ``out.cumsum(0)`` over (tiles, 2) held the whole
    # fingerprint to ~53 GB/s on an H100 (the pinned copy's speed: 20 ms for 1 GiB, the kernel ~0.5 ms).
    running = torch.stack((out[:, 0].contiguous().cumsum(0), out[:, 1].contiguous().cumsum(0)), dim=1)
    at_end = running.index_select(0, table_d.view(n, _ROW)[:, 5])
    return at_end - torch.cat((torch.zeros_like(at_end[:1]), at_end[:-1]))


def _run(table: torch.Tensor, tile_piece: torch.Tensor, out: torch.Tensor, tiles: int) -> None:
    _lanes_kernel[(tiles,)](
        table,
        tile_piece,
        out,
        _ROW,
        BLOCK,
        GOLDEN,
        KEY_SEED,
        LANE_B,
        *FMIX_A,
        *FMIX_B,
        num_warps=4,
    )
