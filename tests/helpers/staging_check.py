"""Checks of async staging on states with what real states hold, for every device and writer: the CPU
(tests/save/test_gather.py, the gathered path forced on) and CUDA (tests/gpu/test_cuda.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from safepoint.save.shared_buffers import buffer_tensors
from safepoint.save.staging import Stager


def check_mixed_state_staging(device: torch.device, shared: bool, gathered: bool = False) -> None:
    """Three saves of a state with a tie, a non-contiguous view, a conjugate view, 0-d tensors, six dtypes,
    nested optimizer state, a CPU tensor beside the others and plain values: every snapshot equals the live
    tensors bit for bit; a tensor replaced by one of the same shape keeps its buffer; a changed shape gets
    new ones. ``gathered``: staging must have taken save/gather.py's path for at least the 400 optimizer
    tensors (each save)."""
    g = torch.Generator(device=device).manual_seed(0)
    tied = torch.randn(64, 32, device=device, generator=g)
    optim = {
        f"p{i}": {"m": torch.randn(100, device=device, generator=g), "step": torch.tensor(1.0, device=device)}
        for i in range(200)
    }
    sd: dict[str, Any] = {
        "emb": tied,
        "head": tied,
        "t": torch.randn(48, 16, device=device, generator=g).t(),
        "half": torch.randn(1000, device=device, generator=g).bfloat16(),
        "z": (z := torch.randn(17, dtype=torch.complex64, device=device, generator=g)),
        "zc": z.conj(),  # the same memory, other values: not a tie
        "d": torch.randn(5, 3, dtype=torch.float64, device=device, generator=g),
        "ids": torch.arange(33, device=device),
        "flags": torch.rand(64, device=device, generator=g) > 0.5,
        "opt": optim,
        "cpu": torch.randn(10),
        "lr": 0.1,
    }
    stager = Stager(shared=shared)

    def check() -> None:
        snap = stager.stage(sd)
        assert snap["emb"] is snap["head"]
        if device.type == "cuda":
            assert all(t.is_pinned() for t in buffer_tensors(snap) if t.numel() > 1), "not pinned"
            if (
                shared or gathered
            ):  # the 0-d steps too: in the pinned segment (shared_buffers.move_into_arena)
                assert all(t.is_pinned() for t in buffer_tensors(snap) if t.numel() > 0), "0-d not pinned"
        for (k, a), (_, b) in zip(_flat(sd), _flat(snap), strict=True):
            if isinstance(a, torch.Tensor):
                assert b.device.type == "cpu" and b is not a and torch.equal(b, a.cpu()), k
            else:
                assert a == b, k
        if gathered:
            assert stager.gathered >= 400, stager.gathered

    try:
        for _ in range(3):
            with torch.no_grad():
                for t in [
                    sd["emb"],
                    sd["t"],
                    sd["half"],
                    sd["d"],
                    *(v for p in optim.values() for v in p.values()),
                ]:
                    t.add_(1.0)
                sd["z"].mul_(1j)
                sd["ids"].add_(1)
                sd["flags"].logical_not_()
            check()
        optim["p3"]["m"] = torch.randn(100, device=device, generator=g)  # replaced, same shape
        check()
        assert stager.allocations == 1
        optim["p4"]["m"] = torch.randn(101, device=device, generator=g)  # another shape
        check()
        assert stager.allocations == 2
    finally:
        stager.release()


def _flat(sd: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(sd, dict):
        return [leaf for k, v in sd.items() for leaf in _flat(v, f"{path}.{k}")]
    return [(path, sd)]


def odd_bits_state(device: torch.device) -> dict[str, Any]:
    """Small tensors whose bit patterns a copy that converts values changes (a NaN's sign and payload in
    bf16, fp16 and float8, bytes of a bool other than 0 and 1) and dtypes outside the usual ones (unsigned
    16-64 bit, float8_e8m0fnu scales, complex32), each twice (a gather needs two side by side), and a
    negative-bit view of an fp16 tensor."""
    raw = {
        torch.bfloat16: [0x7FC1, 0xFFC0, 0x7F81, 0xFF80, 0x8000, 0x0001],
        torch.float16: [0x7E01, 0xFE00, 0x7C01, 0xFC00, 0x8000, 0x0001],
        torch.float8_e5m2: [0x7D, 0x7E, 0xFD, 0x80, 0x01, 0x7C],
        torch.float8_e4m3fn: [0x7F, 0xFF, 0x80, 0x01, 0x7E, 0x00],
        torch.float8_e8m0fnu: [0xFF, 0x00, 0x7F, 0x80, 0x01, 0xFE],
        torch.bool: [0, 1, 2, 255, 1, 0],
        torch.uint16: [0xFFFF, 0x8000, 0, 1, 0x7FFF, 0x1234],
        torch.uint32: [0xFFFFFFFF, 0x80000000, 0, 1, 0x7FFFFFFF, 0x12345678],
        torch.uint64: [2**64 - 1, 2**63, 0, 1, 2**63 - 1, 0x123456789],
        torch.float32: [0x7FC00001, 0xFFC00000, 0x7F800001, 0x80000000, 1, 0],
    }

    def tensor(dtype: torch.dtype, words: list[int]) -> torch.Tensor:
        data = b"".join(w.to_bytes(dtype.itemsize, "little") for w in words)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).to(device)

    out: dict[str, Any] = {str(dtype): [tensor(dtype, w), tensor(dtype, w[::-1])] for dtype, w in raw.items()}
    out["complex32"] = [torch.randn(6, device=device).to(torch.complex32) for _ in range(2)]
    out["neg"] = [torch._neg_view(tensor(torch.float16, w)) for w in (raw[torch.float16], [0x3C00] * 4)]
    return out


def check_odd_bits_staging(
    device: torch.device, shared: bool, each: Callable[[Stager], None] | None = None
) -> None:
    """Three saves of ``odd_bits_state``: every snapshot holds the live tensors' bits unchanged (a
    negative-bit view: its values). ``each``: called after every save, for the caller's checks of the path
    staging took."""
    sd = odd_bits_state(device)
    stager = Stager(shared=shared)
    try:
        for _ in range(3):
            snap = stager.stage(sd)
            if each is not None:
                each(stager)
            for k, lives in sd.items():
                for a, b in zip(lives, snap[k], strict=True):
                    want = a.resolve_neg().cpu().contiguous()
                    assert b.dtype == want.dtype and b.shape == want.shape, k
                    assert bytes(b.view(torch.uint8).numpy()) == bytes(want.view(torch.uint8).numpy()), k
    finally:
        stager.release()
