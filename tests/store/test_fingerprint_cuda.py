"""On a GPU: the device-side fingerprint equals the CPU one, through the fused Triton kernel
(store/fingerprint_triton.py, used where it passes its probe) and through the torch ops
(store/fingerprint.py), and neither fingerprinting, an incremental save of an unchanged CUDA tensor, nor
async staging of one copies that tensor to the host. Skipped without CUDA; run on a GPU machine with
``pytest -q tests/store/test_fingerprint_cuda.py`` (``benchmarks/gpu_check.sh`` does)."""

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


@pytest.fixture(params=["triton", "torch-ops"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which implementation computes the GPU lane sums: the Triton kernel (it must be the one in use where
    Triton imports: the probe passed) or the torch ops (forced)."""
    if request.param == "triton":
        pytest.importorskip("triton")
        from safepoint.store import fingerprint_triton

        dev = torch.device("cuda", torch.cuda.current_device())
        assert fp.fast_path(dev), "the Triton kernel failed its probe (see the log's warning)"
        assert fp._sums_for(dev) is fingerprint_triton.device_sums
    else:
        monkeypatch.setattr(fp, "_sums_for", lambda device: fp._device_sums)
    return str(request.param)


def test_the_gpu_digest_equals_the_cpu_digest(kernel: str) -> None:
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


def test_the_kernel_equals_the_cpu_on_many_tensors_and_pieces(kernel: str) -> None:
    """9,000 tiny tensors in one launch, odd lengths and addresses, and pieces over several launches."""
    from safepoint.store import fingerprint_triton as ft

    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 300, (9000,), generator=g).tolist()
    raw = torch.randint(0, 256, (sum(lengths) + 9000,), dtype=torch.uint8, generator=g)
    raw_gpu = raw.cuda()
    cpu, gpu, at = [], [], 0
    for n in lengths:  # views at every offset: the kernel reads aligned copies of the odd ones
        cpu.append(raw[at : at + n])
        gpu.append(raw_gpu[at : at + n])
        at += n + 1
    assert fingerprint_tensors(gpu) == fingerprint_tensors(cpu)
    if kernel == "triton":
        big = torch.randint(0, 256, (3 * 2**20 + 5,), dtype=torch.uint8, generator=g)
        members = [(0, big.cuda()), (1, gpu[1]), (2, big.cuda()[3:])]
        want = fp._add([(0, 0)] * 3, fp._device_sums(big.device, [(0, big), (1, cpu[1]), (2, big[3:])]))
        for launch_bytes in (2**20, 8 * 1000, None):  # pieces over 4 and 394 launches, and one launch
            got = ft.device_sums(torch.device("cuda", torch.cuda.current_device()), members, launch_bytes)
            assert fp._add([(0, 0)] * 3, got) == want, launch_bytes


def test_fingerprinting_copies_only_the_digest_to_the_host(tmp_path: Path, kernel: str) -> None:
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


@pytest.mark.parametrize("policy", [None, False])
def test_async_staging_copies_only_what_changed_to_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: bool | None
) -> None:
    """The default policy (None): where the Triton kernel is usable, async staging proves an unchanged CUDA
    tensor unchanged on the GPU and does not copy it; False (and no usable kernel): it copies everything."""
    from safepoint.save import staging
    from safepoint.save.staging import Stager

    monkeypatch.setattr(staging, "FINGERPRINT_CUDA_WHEN_STAGING", policy)
    skips = policy is None and fp.fast_path(torch.device("cuda", torch.cuda.current_device()))
    if policy is None:
        pytest.importorskip("triton")
        assert skips, "the Triton kernel failed its probe: staging would copy every CUDA tensor"

    frozen = torch.randn(8 * 1024 * 1024, device="cuda")  # 32 MiB
    trained = torch.randn(1024, device="cuda")
    sd = {"frozen": frozen, "trained": trained}
    stager = Stager()
    stager.stage(sd)
    trained.add_(1.0)
    copied = _dtoh_bytes(lambda: stager.stage(sd), tmp_path)
    if skips:
        assert copied < frozen.nbytes // 2, copied
        assert stager.skipped >= frozen.nbytes
    else:
        assert copied >= frozen.nbytes and stager.skipped == 0, (copied, stager.skipped)
    frozen.data[0] += 1.0  # a write the version counter misses: copied
    snapshot = stager.stage(sd)
    assert torch.equal(snapshot["frozen"], frozen.cpu()) and torch.equal(snapshot["trained"], trained.cpu())
    assert stager.skipped == 0
    small = {"frozen": torch.randn(1024, device="cuda")}  # under FINGERPRINT_CUDA_MIN_BYTES: copied
    stager.stage(small)
    assert stager.stage(small) is not None and stager.skipped == 0
