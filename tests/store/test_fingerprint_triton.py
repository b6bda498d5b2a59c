"""The fused Triton fingerprint kernel (store/fingerprint_triton.py) gives exactly the torch ops' lane sums
(store/fingerprint.py), so its digests are the CPU digests bit for bit.

Triton is not a dev dependency (it comes with CUDA builds of torch), so the kernel tests run only where it
imports, on the CPU through Triton's interpreter, which must be switched on before Triton is imported::

    pip install --target /work/triton-site triton==3.6.0 --no-deps
    TRITON_INTERPRET=1 PYTHONPATH=src:/work/triton-site pytest tests/store/test_fingerprint_triton.py

The interpreter runs each program of the kernel in numpy (~50-100 ms each), so the cases keep the tile
count small; the long version of the many-tensor case is ``slow``. On a GPU, the compiled kernel is checked
against the CPU digests by tests/store/test_fingerprint_cuda.py. The fallback tests at the end run
everywhere.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from typing import Any

import pytest
import torch

import safepoint.store
from safepoint.save import staging
from safepoint.store import fingerprint as fp
from safepoint.store.fingerprint import fingerprint_tensors

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
needs_interpreter = pytest.mark.skipif(
    not INTERPRETER, reason="needs triton importable and TRITON_INTERPRET=1 (see the module docstring)"
)


def _kernel() -> Any:
    from safepoint.store import fingerprint_triton as ft

    if not ft.INTERPRETED:  # imported before TRITON_INTERPRET was set: compiled, it cannot read CPU memory
        pytest.skip("fingerprint_triton was imported without the interpreter")
    return ft


def _by_kernel(tensors: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch, **kw: int) -> list[bytes]:
    """The digests of ``tensors`` with the Triton kernel computing the lane sums (the CPU tensors through
    the interpreter), where fingerprint.py would use it for CUDA tensors."""
    ft = _kernel()
    with monkeypatch.context() as m:
        m.setattr(fp, "_sums_for", lambda device: lambda d, members: ft.device_sums(d, members, **kw))
        return fingerprint_tensors(tensors)


def _cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (64,), dtype=torch.uint8, generator=g)
    out = [
        torch.randn(5, 3, generator=g),
        torch.randn(4, 4, generator=g).to(torch.float16),
        torch.randn(13, generator=g).to(torch.bfloat16),
        torch.randn(3, 7, generator=g).double().t(),  # not contiguous: its logical order
        torch.randint(-128, 128, (11,), dtype=torch.int8, generator=g),
        torch.randint(-(2**15), 2**15, (3, 3), dtype=torch.int16, generator=g),
        torch.randint(-(2**31), 2**31, (5,), dtype=torch.int32, generator=g),
        torch.randint(-(2**62), 2**62, (9,), dtype=torch.int64, generator=g),
        torch.tensor([True, False, True]),
        torch.randn(3, dtype=torch.complex64, generator=g),
        torch.randn(3, dtype=torch.complex128, generator=g).conj(),  # the conj bit resolved
        -torch.randn(2, 2, dtype=torch.complex64, generator=g).conj(),
        torch.tensor(3.0),  # 0-d
        torch.tensor([], dtype=torch.float16),  # empty
        torch.empty(0, 5),
        torch.randn(64, 64, generator=g)[3:40:3, 5:9],
        torch.randn(8 * 1024 + 3, generator=g),  # several tiles (8 KiB each) and a tail
    ]
    if hasattr(torch, "float8_e4m3fn"):
        out.append(torch.randn(7, generator=g).to(torch.float8_e4m3fn))
    # Every tail length 0-7 (1-17 bytes), and views at odd addresses (the kernel reads an aligned copy).
    out += [raw[:n] for n in range(1, 18)] + [raw[1:12], raw[3:40], raw[5:6]]
    return out


@needs_interpreter
def test_kernel_digests_equal_the_torch_ops_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.store.test_fingerprint import reference

    cases = _cases()
    torch_ops = fingerprint_tensors(cases)
    assert _by_kernel(cases, monkeypatch) == torch_ops
    assert [_by_kernel([t], monkeypatch)[0] for t in cases[:4]] == torch_ops[:4]  # alone as in a batch
    # The lane sums themselves against the specification in plain Python integers.
    ft = _kernel()
    for t in (cases[0], cases[3], cases[10], *cases[-6:]):
        lanes = [0, 0]
        for _, chunk in ft.device_sums(t.device, [(0, fp._as_bytes(t))]):
            for a, b in chunk:
                lanes = [(lanes[0] + a) & fp.MASK, (lanes[1] + b) & fp.MASK]
        assert b"".join(x.to_bytes(8, "little") for x in lanes) == reference(t)


@needs_interpreter
@pytest.mark.parametrize("launch_bytes", [16 * 1024, 12344, 8])
def test_pieces_spanning_several_launches(monkeypatch: pytest.MonkeyPatch, launch_bytes: int) -> None:
    """A tensor cut into pieces over several launches (each piece's positions start at its offset in its
    tensor, not at 0), against the torch ops over several chunks of another size."""
    ft = _kernel()
    g = torch.Generator().manual_seed(1)
    big = torch.randn(5 * 2048 + 1, generator=g)  # 5 tiles (8 KiB) and a 4-byte tail
    odd = torch.randint(0, 256, (3 * 8 * 1024 + 5,), dtype=torch.uint8, generator=g)
    tensors = [big, torch.randn(3, generator=g), odd] if launch_bytes > 8 else [odd[:61], odd[:8]]
    launches: list[int] = []
    real = ft._launch

    def counted(device: torch.device, rows: list[tuple[int, int, int, int]]) -> torch.Tensor:
        launches.append(len(rows))
        return real(device, rows)

    monkeypatch.setattr(ft, "_launch", counted)
    monkeypatch.setattr(fp, "CHUNK_BYTES", 8 * 1000)  # the torch ops in chunks too, of another size
    assert _by_kernel(tensors, monkeypatch, launch_bytes=launch_bytes) == fingerprint_tensors(tensors)
    assert len(launches) > 2, launches
    if launch_bytes > 8:
        assert max(launches) >= 2, launches  # a launch holding pieces of several tensors


@needs_interpreter
@pytest.mark.parametrize("n", [1000, pytest.param(5000, marks=pytest.mark.slow)])
def test_many_tiny_tensors_share_one_launch(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    ft = _kernel()
    g = torch.Generator().manual_seed(2)
    dtypes = [torch.float32, torch.uint8, torch.float16, torch.int64, torch.bool, torch.bfloat16]
    tensors = [
        torch.randint(0, 2, (int(k),), generator=g).to(dtypes[i % len(dtypes)])
        for i, k in enumerate(torch.randint(0, 40, (n,), generator=g))
    ]
    launches: list[int] = []
    real = ft._launch
    monkeypatch.setattr(ft, "_launch", lambda device, rows: launches.append(len(rows)) or real(device, rows))
    assert _by_kernel(tensors, monkeypatch) == fingerprint_tensors(tensors)
    assert launches == [sum(1 for t in tensors if t.numel())]  # one launch, a piece per non-empty tensor


@needs_interpreter
def test_every_bit_flip_changes_the_kernel_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(3)
    small = torch.randint(0, 256, (13,), dtype=torch.uint8, generator=g)  # a whole word and a 5-byte tail
    big = torch.randint(0, 256, (2 * 8 * 1024 + 5,), dtype=torch.uint8, generator=g)  # 3 tiles
    flips = [(small, bit) for bit in range(13 * 8)]
    # In the big one: the first word, both sides of each tile boundary, the tail, a few anywhere.
    spots = [0, 8 * 1024 - 1, 8 * 1024, 2 * 8 * 1024 - 1, 2 * 8 * 1024, 2 * 8 * 1024 + 4]
    spots = sorted({*spots, *torch.randint(0, big.numel(), (4,), generator=g).tolist()})
    flips += [(big, 8 * byte + bit) for byte in spots for bit in (0, 7)]
    flipped = []
    for t, bit in flips:
        f = t.clone()
        f[bit // 8] ^= 1 << (bit % 8)
        flipped.append(f)
    digests = _by_kernel([small, big, *flipped], monkeypatch)
    assert len(set(digests)) == len(digests)  # every flip changed its tensor's digest (and no two collide)
    assert digests[2:] == fingerprint_tensors(flipped)


@needs_interpreter
def test_the_probe_accepts_the_kernel_and_rejects_a_wrong_or_failing_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ft = _kernel()
    cpu = torch.device("cpu")
    assert fp._probe(cpu) is ft.device_sums
    real = ft.device_sums

    def off_by_one(device: torch.device, members: Any, launch_bytes: int | None = None) -> Any:
        out = real(device, members, launch_bytes)
        out[-1][1][-1][1] += 1  # one lane of one piece
        return out

    def broken(*args: object, **kwargs: object) -> Any:
        raise RuntimeError("PTX assembly aborted")

    for wrong, said in ((off_by_one, "disagrees"), (broken, "PTX assembly aborted")):
        monkeypatch.setattr(ft, "device_sums", wrong)
        with caplog.at_level(logging.WARNING, logger="safepoint"):
            assert fp._probe(cpu) is None
        assert said in caplog.text


def test_without_triton_fingerprints_use_the_torch_ops(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where Triton does not import, the probe says so and the torch ops compute the lane sums."""
    monkeypatch.setitem(sys.modules, "triton", None)  # ``import triton`` raises ImportError
    monkeypatch.delitem(sys.modules, "safepoint.store.fingerprint_triton", raising=False)
    monkeypatch.delattr(safepoint.store, "fingerprint_triton", raising=False)  # or ``from`` finds it there
    with caplog.at_level(logging.INFO, logger="safepoint"):
        assert fp._probe(torch.device("cpu")) is None
    assert "triton does not import" in caplog.text
    assert fp._sums_for(torch.device("cpu")) is fp._device_sums  # CPU: never the kernel
    assert not fp.fast_path(torch.device("cpu"))


@pytest.mark.parametrize("policy", [None, True, False])
def test_the_staging_policy_follows_the_fast_path(
    monkeypatch: pytest.MonkeyPatch, policy: bool | None
) -> None:
    """``FINGERPRINT_CUDA_WHEN_STAGING``: None (default) fingerprints CUDA tensors of at least
    ``FINGERPRINT_CUDA_MIN_BYTES`` at async staging exactly where the kernel is usable; True and False force
    it. (The probe's verdict is seeded per device here; tests/store/test_fingerprint_cuda.py and
    tests/gpu/test_cuda.py check the real one on a GPU.)"""
    monkeypatch.setattr(staging, "FINGERPRINT_CUDA_WHEN_STAGING", policy)
    # cuda:0 passed the probe (any sums function stands for the kernel's), cuda:1 did not.
    monkeypatch.setattr(
        fp, "_fast", {torch.device("cuda", 0): fp._device_sums, torch.device("cuda", 1): None}
    )
    least = staging.FINGERPRINT_CUDA_MIN_BYTES
    expect = {None: (least, None), True: (0, 0), False: (None, None)}[policy]
    assert tuple(staging.cuda_fingerprint_floor(torch.device("cuda", i)) for i in (0, 1)) == expect
