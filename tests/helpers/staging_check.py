"""One check of async staging on a state with what real states hold, for every device and writer: the CPU
(tests/save/test_gather.py, the gathered path forced on) and CUDA (tests/gpu/test_cuda.py)."""

from __future__ import annotations

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
