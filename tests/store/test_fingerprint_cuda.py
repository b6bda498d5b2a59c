"""On a GPU: the device-side fingerprint (store/fingerprint.py) equals the CPU one, and neither it nor an
incremental save of an unchanged CUDA tensor copies that tensor to the host. Skipped without CUDA; run on a
GPU machine with ``pytest -q tests/store/test_fingerprint_cuda.py``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import safepoint
from safepoint.store import fingerprint as fp
from safepoint.store.fingerprint import fingerprint_tensor, fingerprint_tensors

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.randint(-(2**31), 2**31, ((fp.CHUNK_BYTES * 2 + 12) // 4,), dtype=torch.int32, generator=g)
    return [
        torch.randn(5, 3, generator=g),
        torch.arange(7, dtype=torch.uint8),
        torch.tensor([], dtype=torch.float16),
        torch.tensor(3.0),
        torch.tensor([True, False, True]),
        torch.randn(3, dtype=torch.complex64, generator=g).conj(),
        torch.randint(-(2**62), 2**62, (9,), dtype=torch.int64, generator=g),
        torch.randn(13, 7, generator=g).to(torch.bfloat16).t(),
        torch.randn(64, 64, generator=g)[3:40:3, 5:9],
        big,  # several chunks, an odd number of 4-byte words
    ]


def test_the_gpu_digest_equals_the_cpu_digest() -> None:
    cpu = _cases()
    gpu = [t.cuda() for t in cpu]
    assert [fingerprint_tensor(t) for t in gpu] == [fingerprint_tensor(t) for t in cpu]
    assert fingerprint_tensors(gpu) == fingerprint_tensors(cpu)
    # A mix of devices in one call.
    mixed = [t if i % 2 else t.cuda() for i, t in enumerate(cpu)]
    assert fingerprint_tensors(mixed) == fingerprint_tensors(cpu)
    # Every single-bit flip of a GPU tensor changes its digest.
    t = torch.randn(33, device="cuda")
    base = fingerprint_tensor(t)
    raw = t.view(torch.uint8)
    seen = set()
    for bit in range(raw.numel() * 8):
        flipped = raw.clone()
        flipped[bit // 8] ^= 1 << (bit % 8)
        seen.add(fingerprint_tensor(flipped.view(torch.float32)))
    assert len(seen) == raw.numel() * 8 and base not in seen


def _dtoh_bytes(work: Callable[[], object], tmp_path: Path) -> int:
    """Bytes the CUDA runtime copied device-to-host while ``work`` ran (the profiler's memcpy records)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        work()
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text()).get("traceEvents", [])
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")]
    return sum(int(e.get("args", {}).get("bytes", 0)) for e in copies)


def test_fingerprinting_copies_only_the_digest_to_the_host(tmp_path: Path) -> None:
    t = torch.randn(16 * 1024 * 1024, device="cuda")  # 64 MiB
    fingerprint_tensor(t)  # warm-up (allocator, kernels)
    copied = _dtoh_bytes(lambda: fingerprint_tensor(t), tmp_path)
    assert copied <= 1024, copied
    many = [torch.randn(1000, device="cuda") for _ in range(500)]
    assert _dtoh_bytes(lambda: fingerprint_tensors(many), tmp_path) <= 500 * 16 + 1024


class _Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(2048, 2048)  # 16 MiB, frozen
        self.base.requires_grad_(False)
        self.head = nn.Linear(2048, 8)


def test_an_unchanged_cuda_tensor_is_linked_without_a_copy_to_the_host(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Frozen().cuda()
    state = safepoint.TrainState(model=model)
    frozen = model.base.weight.numel() * 4
    with safepoint.CheckpointManager(tmp_path / "root", save_every_steps=1, async_save=False) as mgr:
        for step in (1, 2):
            with torch.no_grad():
                model.head.weight.add_(1.0)
            mgr.save(step, state)
        with torch.no_grad():
            model.head.weight.add_(1.0)
        copied = _dtoh_bytes(lambda: mgr.save(3, state), tmp_path)
    step3 = json.loads((tmp_path / "root" / "step-3" / "safepoint.json").read_text())
    assert step3["extra"]["incremental"]["linked"] >= frozen
    assert copied < frozen // 2, copied  # the head and the bias, not the frozen base
    restored = _Frozen().cuda()
    with safepoint.CheckpointManager(tmp_path / "root") as mgr:
        assert mgr.restore(safepoint.TrainState(model=restored)) == 3
    for a, b in zip(model.state_dict().values(), restored.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_async_staging_copies_only_what_changed_to_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safepoint.save import staging
    from safepoint.save.staging import Stager

    # Off by default (the GPU fingerprint costs more blocking time than the copy it spares): the skip itself.
    monkeypatch.setattr(staging, "FINGERPRINT_CUDA_WHEN_STAGING", True)

    frozen = torch.randn(8 * 1024 * 1024, device="cuda")  # 32 MiB
    trained = torch.randn(1024, device="cuda")
    sd = {"frozen": frozen, "trained": trained}
    stager = Stager()
    stager.stage(sd)
    trained.add_(1.0)
    copied = _dtoh_bytes(lambda: stager.stage(sd), tmp_path)
    assert copied < frozen.nbytes // 2, copied
    assert stager.skipped >= frozen.nbytes
    frozen.data[0] += 1.0  # a write the version counter misses: copied
    snapshot = stager.stage(sd)
    assert torch.equal(snapshot["frozen"], frozen.cpu()) and torch.equal(snapshot["trained"], trained.cpu())
