"""The device-side content fingerprint (store/fingerprint.py): the specified algorithm, computed by torch ops
that the GPU runs the same way (tests/store/test_fingerprint_cuda.py checks that on a GPU)."""

from __future__ import annotations

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from safepoint.store import fingerprint as fp
from safepoint.store.fingerprint import fingerprint_tensor, fingerprint_tensors

_M = (1 << 64) - 1


def _mix(x: int, spec: tuple[int, int, int, int, int]) -> int:
    s1, m1, s2, m2, s3 = spec
    x ^= x >> s1
    x = (x * m1) & _M
    x ^= x >> s2
    x = (x * m2) & _M
    return x ^ (x >> s3)


def reference(t: torch.Tensor) -> bytes:
    """Lanes A and B of the module docstring, in plain Python integers (unsigned, masked to 64 bits)."""
    t = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    data += b"\0" * (-len(data) % 8)
    a = b = 0
    for i in range(len(data) // 8):
        w = int.from_bytes(data[8 * i : 8 * i + 8], "little")
        k = _mix((i * fp.GOLDEN + fp.KEY_SEED) & _M, fp._FMIX_A)
        a = (a + _mix(w ^ k, fp._FMIX_A)) & _M
        b = (b + _mix((w + k * fp.LANE_B) & _M, fp._FMIX_B)) & _M
    return a.to_bytes(8, "little") + b.to_bytes(8, "little")


def _lanes(t: torch.Tensor) -> bytes:
    """The 16 bytes of lane sums the device computes for ``t`` (what the digest is made of)."""
    sums = [s for _, chunk in fp._device_sums(t.device, [(0, fp._as_bytes(t))]) for s in chunk]
    a = sum(s[0] for s in sums) & _M
    b = sum(s[1] for s in sums) & _M
    return a.to_bytes(8, "little") + b.to_bytes(8, "little")


CASES = [
    torch.randn(5, 3),
    torch.arange(7, dtype=torch.uint8),
    torch.tensor([], dtype=torch.float16),
    torch.tensor(3.0),
    torch.tensor([True, False, True]),
    torch.randn(3, dtype=torch.complex64),
    torch.randint(-(2**62), 2**62, (9,), dtype=torch.int64),
    torch.randn(13, dtype=torch.bfloat16),
]


@pytest.mark.parametrize("t", CASES, ids=lambda t: f"{t.dtype}{tuple(t.shape)}")
def test_torch_ops_compute_the_specified_algorithm(t: torch.Tensor) -> None:
    assert _lanes(t) == reference(t)


def test_the_digest_is_xxh3_of_the_header_and_the_lanes() -> None:
    t = torch.randn(3, 4)
    h = xxhash.xxh3_128(fp._TAG)
    h.update(repr(("torch.float32", (3, 4), 48)).encode())
    h.update(reference(t))
    assert fingerprint_tensor(t) == h.digest()


def test_tensors_over_several_chunks_equal_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pieces of one tensor in different chunks, small tensors sharing a chunk: the same lanes as one pass.
    monkeypatch.setattr(fp, "CHUNK_BYTES", 64)
    ts = [torch.randn(50), torch.randn(3), torch.arange(33, dtype=torch.uint8), torch.randn(40)]
    for t in ts:
        assert _lanes(t) == reference(t)
    together = fingerprint_tensors(ts)
    monkeypatch.setattr(fp, "CHUNK_BYTES", 32 * 1024 * 1024)
    assert together == [fingerprint_tensor(t) for t in ts]


def _flip(t: torch.Tensor, bit: int) -> torch.Tensor:
    raw = t.contiguous().reshape(-1).view(torch.uint8).clone()
    raw[bit // 8] ^= 1 << (bit % 8)
    return raw.view(t.dtype).reshape(t.shape)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.int64, torch.uint8, torch.float16, torch.float64]),
    seed=st.integers(0, 2**31),
    data=st.data(),
)
def test_every_single_bit_flip_changes_the_digest(
    n: int, dtype: torch.dtype, seed: int, data: st.DataObject
) -> None:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(
        0, 256, (n * torch.tensor([], dtype=dtype).element_size(),), dtype=torch.uint8, generator=g
    )
    t = t.view(dtype)
    bits = t.numel() * t.element_size() * 8
    bit = data.draw(st.integers(0, bits - 1))
    assert fingerprint_tensor(_flip(t, bit)) != fingerprint_tensor(t)


def test_every_bit_of_a_small_tensor_matters() -> None:
    t = torch.randn(37)  # 148 bytes: a padded last word
    base = fingerprint_tensor(t)
    digests = {fingerprint_tensor(_flip(t, bit)) for bit in range(148 * 8)}
    assert len(digests) == 148 * 8 and base not in digests


def test_flipping_the_top_bit_of_two_words_changes_it() -> None:
    # A position-weighted int64 sum collides here: each term moves by 2**63 (times an odd weight).
    w = torch.zeros(16, dtype=torch.int64)
    flipped = w.clone()
    flipped[3] ^= -(2**63)
    flipped[10] ^= -(2**63)
    assert fingerprint_tensor(flipped) != fingerprint_tensor(w)
    both = w.clone()
    both[0] = both[1] = -(2**63)
    assert fingerprint_tensor(both) != fingerprint_tensor(w)


def test_swapping_two_words_changes_it() -> None:
    t = torch.arange(10, dtype=torch.int64)
    swapped = t.clone()
    swapped[[2, 7]] = swapped[[7, 2]]
    assert fingerprint_tensor(swapped) != fingerprint_tensor(t)


def test_dtype_shape_and_length_are_part_of_it() -> None:
    x = torch.zeros(8, dtype=torch.float32)
    assert len({fingerprint_tensor(v) for v in (x, x.view(torch.int32), x.reshape(2, 4), x[:7])}) == 4
    # Zero padding of the last word never makes two lengths equal.
    assert fingerprint_tensor(torch.zeros(3, dtype=torch.uint8)) != fingerprint_tensor(
        torch.zeros(8, dtype=torch.uint8)
    )


def test_views_and_non_contiguous_tensors_hash_their_values() -> None:
    base = torch.randn(6, 8)
    t = base.t()  # non-contiguous
    assert fingerprint_tensor(t) == fingerprint_tensor(t.contiguous())
    sl = base[2:4, 1:5]  # a view into a bigger storage, odd strides
    assert fingerprint_tensor(sl) == fingerprint_tensor(sl.clone())
    c = torch.randn(4, dtype=torch.complex64)
    assert fingerprint_tensor(c.conj()) == fingerprint_tensor(c.conj().resolve_conj())
    assert fingerprint_tensor(c.conj()) != fingerprint_tensor(c)
    odd = torch.arange(11, dtype=torch.uint8)[1::2]
    assert fingerprint_tensor(odd) == fingerprint_tensor(odd.contiguous())
    assert fingerprint_tensor(torch.empty(0, 5)) != fingerprint_tensor(torch.empty(5, 0))


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_subclasses_and_other_layouts_are_refused() -> None:
    with pytest.raises(TypeError):
        fingerprint_tensor(torch.zeros(3).to_sparse())
    with pytest.raises(TypeError):
        fingerprint_tensor(torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.quint8))
    assert len(fingerprint_tensor(torch.nn.Parameter(torch.zeros(3)))) == 16


def test_a_cpu_fingerprint_starts_from_its_own_headers_state_whatever_the_cache_holds() -> None:
    """The xxh3 states seeded with a header are cached by (dtype, shape, strides): each digest still equals
    xxh3-128 of its own header then its bytes, and a tensor of the same bytes in another dtype, shape or
    strides (its header met before or not) never gets another's."""
    from safepoint.store.fingerprint import fingerprints
    from safepoint.store.item_writer import tensor_bytes

    def reference(t: torch.Tensor) -> bytes:
        h = xxhash.xxh3_128(repr((str(t.dtype), tuple(t.shape), t.stride())).encode())
        h.update(tensor_bytes(t))
        return h.digest()

    base = torch.arange(24, dtype=torch.float32)
    kinds = [base, base.view(4, 6), base.view(6, 4), base.view(torch.int32), base.view(2, 3, 4)]
    for _ in range(2):  # the second round finds every header cached
        got = fingerprints(kinds)
        assert got == [reference(t) for t in kinds]
        assert len(set(got)) == len(kinds)
    wide = torch.zeros(4, 12)[:, :6].contiguous()  # the (4, 6) shape again, another tensor's bytes
    assert fingerprints([wide]) == [reference(wide)]
