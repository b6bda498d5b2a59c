"""A content fingerprint computed with torch ops where the tensor lives (issue 26).

For a CUDA tensor the whole computation runs on the GPU and only 16 bytes per tensor come back to the
host: an unchanged tensor costs no device-to-host copy of its bytes. The same ops run on the CPU and give
the same digest (integer arithmetic wraps identically everywhere, and the reductions are sums, which do not
depend on the order the device adds in), so the CPU tests prove the algorithm and a GPU run checks the two
agree (tests/store/test_fingerprint_cuda.py).

It must detect change, not just look like a hash: a position-weighted linear sum of the words collides
deterministically (flip the top bit of two words: each term moves by 2**63, the sum by 2**64 == 0). Here:

- the tensor's bytes (logical order, contiguous; conj/neg bits resolved) are zero-padded to a multiple of
  8 and read as int64 words ``w_i`` (wrapping arithmetic throughout);
- a position key ``k_i = fmix_a(i * GOLDEN + KEY_SEED)`` (murmur3's fmix64 on the word's index);
- two lanes, each a sum of a nonlinear, bijective xor-shift-multiply mix of the keyed word:
  ``A = sum fmix_a(w_i ^ k_i)`` and ``B = sum fmix_b(w_i + k_i * LANE_B)`` (fmix_b is splitmix64's
  finalizer), each 64 bits, different mixers and keyings, so the two lanes are independent;
- the digest: xxh3-128 over a tag, the dtype, the shape, the byte length and (A, B): 128 bits.

One flipped bit changes the mixed word it is in to an unrelated value (the mixers are bijections with full
avalanche), so A and B each change unless a 64-bit coincidence happens; both at once is a 2**-128 event. The
byte length is in the digest, so the zero padding cannot make two lengths equal.

Cost: about 40 elementwise int64 passes per word. On an H100 that is ~70 ms per GiB (4.5 ms for 64 MiB,
docs/benchmarks.md); on the CPU it is ~500x slower than xxh3 over the bytes, so CPU tensors keep the host
hash (``fingerprints`` below). Words are processed in chunks of ``CHUNK_BYTES`` (bounded scratch memory
on the device); many small tensors share a chunk, so a model of thousands of tensors costs a few dozen
kernel launches per chunk, not per tensor.

So a CUDA tensor's lane sums come from a fused Triton kernel where one is usable (store/fingerprint_triton.py:
one read of each word, the same sums bit for bit), decided once per device by ``fast_path``, which runs it
against these torch ops on a probe first; these ops remain the specification, the CPU's path and the
fallback (no Triton, a failed compile, a disagreement).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import torch
import xxhash

from safepoint.store.fingerprint_spec import FMIX_A, FMIX_B, GOLDEN, KEY_SEED, LANE_B, MASK
from safepoint.store.item_writer import tensor_bytes

# Words per chunk: scratch on the device is a few times this many bytes (CHUNK_BYTES * ~5).
CHUNK_BYTES = 32 * 1024 * 1024
_TAG = b"safepoint-fp1"
_MASK = MASK
_FMIX_A = FMIX_A  # murmur3 fmix64
_FMIX_B = FMIX_B  # splitmix64's finalizer

log = logging.getLogger("safepoint")
Sums = Callable[[torch.device, list[tuple[int, torch.Tensor]]], list[tuple[list[int], list[list[int]]]]]
"""(device, [(owner, flat uint8 view)]) -> per launch or chunk: (owner per piece, [A, B] per piece)."""


def _signed(x: int) -> int:
    """``x`` mod 2**64 as a signed int64 (what a torch int64 holds)."""
    x &= _MASK
    return x - (1 << 64) if x >> 63 else x


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's ``>>`` on int64 is arithmetic: it copies the sign)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _fmix(x: torch.Tensor, spec: tuple[int, int, int, int, int]) -> torch.Tensor:
    s1, m1, s2, m2, s3 = spec
    x = x ^ _srl(x, s1)
    x = x * _signed(m1)  # int64 multiply wraps mod 2**64 on every device
    x ^= _srl(x, s2)
    x *= _signed(m2)
    x ^= _srl(x, s3)
    return x


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as flat uint8 in logical order, on its device (a copy only if not contiguous)."""
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        raise TypeError(f"cannot fingerprint a {type(t).__name__} (a tensor subclass)")
    if t.layout != torch.strided or t.is_quantized:
        raise TypeError(f"cannot fingerprint a {t.layout} tensor{' (quantized)' if t.is_quantized else ''}")
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _piece_sums(words: torch.Tensor, positions: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """(pieces, 2) int64: lane A and lane B summed over each piece (``ends``: exclusive word ends)."""
    keys = _fmix(positions * _signed(GOLDEN) + _signed(KEY_SEED), _FMIX_A)
    a = _fmix(words ^ keys, _FMIX_A)
    b = _fmix(words + keys * _signed(LANE_B), _FMIX_B)
    del keys
    # Per piece by differences of running sums: integer and wrapping, the same on every device (no atomics).
    lanes = torch.stack((a.cumsum(0), b.cumsum(0)), dim=1)
    at_end = lanes.index_select(0, ends - 1)
    before = torch.cat((torch.zeros_like(at_end[:1]), at_end[:-1]))
    return at_end - before


def fingerprint_tensors(tensors: Sequence[torch.Tensor]) -> list[bytes]:
    """A 16-byte content fingerprint of each tensor (dtype, shape and values), computed on its device.

    Only the 16-byte lane sums of each tensor leave the device. Raises TypeError for tensor subclasses,
    sparse and quantized tensors."""
    views = [_as_bytes(t) for t in tensors]
    sums = [(0, 0)] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(views):
        by_device.setdefault(v.device, []).append(i)
    for device, members in by_device.items():
        _add(sums, _sums_for(device)(device, [(i, views[i]) for i in members]))
    out = []
    for t, (a, b) in zip(tensors, sums, strict=True):
        h = xxhash.xxh3_128(_TAG)
        h.update(repr((str(t.dtype), tuple(t.shape), t.numel() * t.element_size())).encode())
        h.update(a.to_bytes(8, "little") + b.to_bytes(8, "little"))
        out.append(h.digest())
    return out


def fingerprint_tensor(t: torch.Tensor) -> bytes:
    """``fingerprint_tensors([t])[0]``."""
    return fingerprint_tensors([t])[0]


def _device_sums(
    device: torch.device, members: list[tuple[int, torch.Tensor]]
) -> list[tuple[list[int], list[list[int]]]]:
    """Every chunk's (owner per piece, [A, B] per piece); the chunks' sums come back in one copy."""
    pending: list[tuple[list[int], torch.Tensor]] = []
    parts: list[torch.Tensor] = []
    owners: list[int] = []
    starts: list[int] = []  # each piece's first word index within its tensor
    counts: list[int] = []  # words per piece
    filled = 0
    pad = torch.zeros(8, dtype=torch.uint8, device=device)

    def flush() -> None:
        nonlocal filled
        if not parts:
            return
        words = torch.cat(parts).view(torch.int64)
        n = torch.tensor(counts, dtype=torch.int64)
        # Each word's index within its own tensor: its index in the chunk, shifted per piece. Only the
        # per-piece numbers travel to the device; the per-word ones are made there.
        shift = (torch.tensor(starts, dtype=torch.int64) - (torch.cumsum(n, 0) - n)).to(device)
        positions = torch.arange(words.numel(), dtype=torch.int64, device=device)
        positions += torch.repeat_interleave(shift, n.to(device), output_size=words.numel())
        ends = torch.cumsum(n, 0).to(device)
        pending.append((list(owners), _piece_sums(words, positions, ends)))
        for scratch in (parts, owners, starts, counts):
            scratch.clear()
        filled = 0

    for owner, data in members:
        total = data.numel()
        for start in range(0, total, CHUNK_BYTES):  # CHUNK_BYTES is a multiple of 8: pieces stay word-aligned
            piece = data[start : start + CHUNK_BYTES]
            extra = -piece.numel() % 8
            parts.append(piece)
            if extra:
                parts.append(pad[:extra])
            owners.append(owner)
            starts.append(start // 8)
            counts.append((piece.numel() + extra) // 8)
            filled += piece.numel() + extra
            if filled >= CHUNK_BYTES:
                flush()
    flush()
    if not pending:
        return []
    # The one device-to-host copy: 16 bytes per piece.
    host = torch.cat([s for _, s in pending]).cpu().tolist()
    out, at = [], 0
    for who, sums_ in pending:
        out.append((who, host[at : at + len(who)]))
        at += len(sums_)
    return out


_fast: dict[torch.device, Sums | None] = {}
_fast_lock = threading.Lock()


def fast_path(device: torch.device) -> bool:
    """Whether tensors on ``device`` are fingerprinted by the fused Triton kernel
    (store/fingerprint_triton.py, about one read of the bytes) rather than by the torch ops here (~70 ms/GiB
    on an H100). Decided once per device: a CUDA device, Triton imports, the kernel compiles and runs, and
    its lane sums equal the torch ops' on a probe (tails, several tiles, pieces over several launches, an
    unaligned view). Anything else keeps the torch ops (no Triton, a broken install, a driver or card it
    does not support, a miscompile): slower, never a wrong digest."""
    return _fast_sums(device) is not None


def _sums_for(device: torch.device) -> Sums:
    return _fast_sums(device) or _device_sums


def _fast_sums(device: torch.device) -> Sums | None:
    if device.type != "cuda":
        return None  # CPU tensors keep the host hash (``fingerprints``); the kernel is for GPU memory
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _fast_lock:  # a sync save's thread and a writer thread may ask at once: one probe per device
        if device not in _fast:
            _fast[device] = _probe(device)
        return _fast[device]


def _probe(device: torch.device) -> Sums | None:
    """The Triton kernel's sums if it imports, runs on ``device`` and agrees with the torch ops there."""
    try:
        from safepoint.store import fingerprint_triton as ft
    except Exception as exc:  # ImportError, or an install that fails as it loads
        log.info("safepoint: GPU fingerprints use torch ops: triton does not import (%s)", exc)
        return None
    try:
        g = torch.Generator().manual_seed(26)
        lengths = (5, 8, 13, 8 * ft.BLOCK, 8 * ft.BLOCK * 3 + 7, 4096 + 3)
        data = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device) for n in lengths]
        probe = [*enumerate(data), (len(data), data[-1][1:])]  # the last: at an odd address
        want = _add([(0, 0)] * len(probe), _device_sums(device, probe))
        # Launches of two tiles: the 3-tile tensor spans two launches (position keys across pieces).
        got = _add([(0, 0)] * len(probe), ft.device_sums(device, probe, launch_bytes=16 * ft.BLOCK))
        if got == _add([(0, 0)] * len(probe), ft.device_sums(device, probe)) == want:
            return ft.device_sums
        log.warning(
            "safepoint: the Triton fingerprint kernel disagrees with torch ops on %s: not used", device
        )
    except Exception as exc:  # it fails to compile or to launch: the torch ops, which always work
        log.warning("safepoint: the Triton fingerprint kernel failed on %s (%s): not used", device, exc)
    return None


def _add(
    totals: list[tuple[int, int]], chunks: list[tuple[list[int], list[list[int]]]]
) -> list[tuple[int, int]]:
    """Add each piece's lane sums to its owner's (A, B) in ``totals`` (wrapping mod 2**64); returns it."""
    for owners, lanes in chunks:
        for owner, (a, b) in zip(owners, lanes, strict=True):
            totals[owner] = ((totals[owner][0] + a) & _MASK, (totals[owner][1] + b) & _MASK)
    return totals


def version_counter(t: torch.Tensor) -> int | None:
    """``t``'s autograd version counter: a hint that it was written to since it was last seen. None for an
    inference tensor (made under ``torch.inference_mode``), which has none: ``t._version`` raises there, and
    such a tensor is then always fingerprinted (the hint is only ever allowed to spare a fingerprint)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _eligible(t: torch.Tensor) -> bool:
    """Whether ``t``'s saved form is a function of its dtype, shape, strides and bytes only (not a subclass,
    quantized, conj/neg bits, or a view into a bigger storage): anything else counts as changed, always."""
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


# xxh3-128 states that have hashed a CPU tensor's header (dtype, shape, strides), by that header: each
# fingerprint starts from a copy of one instead of a repr, an encode and a hash of it (~3 us of a small
# state's ~8 us per tensor, issue 27). Safe: the header is a pure function of the key, and a copied state
# continues exactly as the one copied would. Bounded as the item writer's templates are.
_headers: dict[tuple[torch.dtype, torch.Size, tuple[int, ...]], xxhash.xxh3_128] = {}
_MAX_HEADERS = 4096


def _header(dtype: torch.dtype, shape: torch.Size, stride: tuple[int, ...]) -> xxhash.xxh3_128:
    """A new xxh3-128 state that has hashed ``repr((str(dtype), tuple(shape), stride))``."""
    key = (dtype, shape, stride)
    seeded = _headers.get(key)
    if seeded is None:
        seeded = xxhash.xxh3_128(repr((str(dtype), tuple(shape), stride)).encode())
        if len(_headers) >= _MAX_HEADERS:
            _headers.clear()
        _headers[key] = seeded
    return seeded.copy()


def fingerprints(tensors: list[torch.Tensor]) -> list[bytes | None]:
    """Each tensor's fingerprint (None: not eligible, counts as changed). A CPU tensor: xxh3-128 of its
    bytes (the cheapest hash of host memory: ~50x faster than the torch-ops fingerprint on the CPU,
    docs/benchmarks.md). Any other device: store/fingerprint.py's, computed on that device (by the Triton
    kernel where ``fast_path``), so an unchanged GPU tensor is never copied to the host; only 16 bytes per
    tensor come back. Both are mixed with the dtype, shape and strides, and a scheme tag, so a tensor that
    moved device counts as changed."""
    out: list[bytes | None] = [None] * len(tensors)
    on_device: list[int] = []
    for i, t in enumerate(tensors):
        if not _eligible(t):
            continue
        if not t.is_cpu:
            on_device.append(i)
            continue
        h = _header(t.dtype, t.shape, t.stride())
        if t.numel():
            h.update(tensor_bytes(t))
        out[i] = h.digest()
    if on_device:
        digests = fingerprint_tensors([tensors[i] for i in on_device])
        for i, digest in zip(on_device, digests, strict=True):
            t = tensors[i]
            h = xxhash.xxh3_128(repr(("device", str(t.dtype), tuple(t.shape), t.stride())).encode())
            h.update(digest)
            out[i] = h.digest()
    return out


def fingerprint(t: torch.Tensor) -> bytes | None:
    """``fingerprints([t])[0]``."""
    return fingerprints([t])[0]
