"""crc32c plumbing: the overlapped write path, range checksums and their combination, ranged verify."""

from __future__ import annotations

import itertools
import os
import random
from pathlib import Path

import crc32c
import pytest
import torch

import safepoint
from safepoint.errors import CorruptCheckpointError
from safepoint.store import checksum
from safepoint.store.checksum import (
    ChecksummingWriter,
    ChecksumRecorder,
    crc32c_combine,
    crc_hex,
    crc_ranges,
    file_crc32c,
    range_crc32c,
)
from safepoint.store.posix_layout import Layout


@pytest.mark.parametrize("overlap", [False, True])
def test_writer_checksums_every_byte_inline_and_overlapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    monkeypatch.setattr(checksum, "_OVERLAP_MIN", 1024)
    monkeypatch.setattr(checksum, "_usable_cpus", lambda: 64 if overlap else 2)
    rng = random.Random(0)
    tensor = torch.randn(3000)  # a non-byte memoryview format, as torch hands out for storages
    pieces: list[object] = [
        b"header",
        os.urandom(5000),
        bytearray(os.urandom(100)),
        memoryview(tensor.numpy()),  # type: ignore[arg-type]
        os.urandom(rng.randrange(2000, 9000)),
    ]
    recorder = ChecksumRecorder()
    path = tmp_path / "f.bin"
    with open(path, "wb") as raw, ChecksummingWriter(raw, "f.bin", recorder) as w:
        for p in pieces:
            assert w.write(p) == memoryview(p).nbytes  # type: ignore[arg-type]
        assert (w._helper is not None) == overlap
    assert w._helper is None  # the helper thread is gone after close
    size, crc = recorder.snapshot()["f.bin"]
    assert (size, crc) == file_crc32c(path)
    assert crc == crc_hex(crc32c.crc32c(path.read_bytes()))


class _HalfWriter:
    """A raw stream that accepts only half of each write (a short write)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, b: object) -> int:
        view = memoryview(b).cast("B")  # type: ignore[arg-type]
        n = max(1, view.nbytes // 2)
        self.data += view[:n]
        return n

    def close(self) -> None:
        pass


@pytest.mark.parametrize("overlap", [False, True])
def test_short_write_checksums_only_what_was_written(monkeypatch: pytest.MonkeyPatch, overlap: bool) -> None:
    monkeypatch.setattr(checksum, "_OVERLAP_MIN", 16)
    monkeypatch.setattr(checksum, "_usable_cpus", lambda: 64 if overlap else 1)
    raw = _HalfWriter()
    recorder = ChecksumRecorder()
    w = ChecksummingWriter(raw, "x", recorder)  # type: ignore[arg-type]
    assert w.write(os.urandom(100)) == 50
    assert w.write(os.urandom(7)) == 3
    w.close()
    assert recorder.snapshot()["x"] == (53, crc_hex(crc32c.crc32c(bytes(raw.data))))


def test_crc32c_combine_matches_the_concatenation() -> None:
    rng = random.Random(1)
    for la, lb in [(0, 0), (1, 0), (0, 5), (1000, 3000), (7, 1 << 20), (3, 12345), (rng.randrange(99), 77)]:
        a, b = os.urandom(la), os.urandom(lb)
        assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), lb) == crc32c.crc32c(a + b)


def test_crc32c_combine_for_lengths_past_32_bits_of_bit_count() -> None:
    # zlib's CRC-32 table repeats with period 32; the Castagnoli one must not wrap: 2**29 bytes = 2**32
    # bits. Combining is appending: doing it in two halves must equal doing it at once.
    for c in (0, 0x12345678, 0xFFFFFFFF):
        half = crc32c_combine(crc32c_combine(c, 0, 2**28), 0, 2**28)
        assert half == crc32c_combine(c, 0, 2**29)
        assert crc32c_combine(crc32c_combine(c, 0, 2**40), 0, 3) == crc32c_combine(c, 0, 2**40 + 3)
    zeros = bytes(3 << 20)
    assert crc32c_combine(0xABCDEF01, crc32c.crc32c(zeros), len(zeros)) == crc32c.crc32c(zeros, 0xABCDEF01)


def test_ranges_cover_the_file_and_combine_to_its_checksum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checksum, "_MIN_RANGE", 1000)
    assert crc_ranges(0, 8) == [(0, 0)]
    assert crc_ranges(999, 8) == [(0, 999)]
    for size in (1000, 4321, 100_000):
        parts = crc_ranges(size, 8)
        assert 1 <= len(parts) <= 8
        assert parts[0][0] == 0 and sum(n for _, n in parts) == size
        assert all(off + n == nxt for (off, n), (nxt, _) in itertools.pairwise(parts))
    data = os.urandom(100_003)
    path = tmp_path / "f"
    path.write_bytes(data)
    value = 0
    for i, (off, n) in enumerate(crc_ranges(len(data), 8)):
        part = range_crc32c(path, off, n)
        value = part if i == 0 else crc32c_combine(value, part, n)
    assert value == crc32c.crc32c(data)
    with pytest.raises(EOFError):
        range_crc32c(path, len(data) - 10, 20)


def _checkpoint(root: Path) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Linear(300, 300)
    with safepoint.CheckpointManager(root) as mgr:
        info = mgr.save(3, safepoint.TrainState(model=model, rng=False))
    assert info is not None
    return Path(info.path)


def test_verify_reads_big_files_in_ranges_and_catches_a_flip_in_any_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    step_dir = _checkpoint(tmp_path / "ckpt")
    monkeypatch.setattr(checksum, "_MIN_RANGE", 4096)  # the ~360 KB data file becomes 8 ranges
    layout = Layout(tmp_path / "ckpt")
    layout.verify(3)  # intact: every range combines to the recorded checksum
    data_file = next(step_dir.glob("*.distcp"))
    size = data_file.stat().st_size
    assert len(crc_ranges(size, 8)) == 8
    for where in (10, size // 2, size - 3):  # first, a middle and the last range
        original = data_file.read_bytes()
        flipped = bytearray(original)
        flipped[where] ^= 0x01
        data_file.write_bytes(bytes(flipped))
        with pytest.raises(CorruptCheckpointError, match="contents altered") as e:
            layout.verify(3)
        assert e.value.file == data_file.name
        data_file.write_bytes(original)
    layout.verify(3)


# ---- torch's own zip CRC-32 is off inside safepoint's writer, and only there ----------------------------


def _item_crcs(step_dir: Path) -> list[int]:
    """The CRC-32 fields of every record of every tensor item torch.save wrote into the checkpoint."""
    import io
    import zipfile

    from safepoint.store.storage import read_metadata_file

    md = read_metadata_file(step_dir / ".metadata")
    crcs: list[int] = []
    for info in md.storage_data.values():
        blob = (step_dir / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        with zipfile.ZipFile(io.BytesIO(blob)) as zf:
            crcs += [zi.CRC for zi in zf.infolist() if "/data/" in zi.filename and zi.file_size]
    return crcs


@pytest.mark.parametrize("skip", [True, False])
def test_save_skips_torch_crc32_and_restores_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, skip: bool
) -> None:
    from safepoint.store import crc_switch

    monkeypatch.setattr(crc_switch, "SKIP_TORCH_CRC32", skip)
    model = torch.nn.Linear(64, 64)
    assert torch.serialization.get_crc32_options()
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        info = mgr.save(1, safepoint.TrainState(model=model))
        assert info is not None
        crcs = _item_crcs(Path(info.path))
        assert crcs
        # Written without torch's CRC-32 (zero fields) unless switched off; our crc32c covers the bytes.
        assert all(c == 0 for c in crcs) if skip else all(c != 0 for c in crcs)
        assert torch.serialization.get_crc32_options()  # the process-wide setting is back
        restored = torch.nn.Linear(64, 64)
        assert mgr.restore(safepoint.TrainState(model=restored)) == 1
    assert torch.equal(restored.weight, model.weight)


def test_crc32_switch_counts_nested_users_and_keeps_a_users_own_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from safepoint.store import crc_switch as storage

    monkeypatch.setattr(storage, "SKIP_TORCH_CRC32", True)
    with storage.torch_crc32_off():
        with storage.torch_crc32_off():  # a second writer (another manager's thread)
            assert not torch.serialization.get_crc32_options()
        assert not torch.serialization.get_crc32_options()  # the first one is still writing
    assert torch.serialization.get_crc32_options()
    # A user who turned it off before keeps it off.
    torch.serialization.set_crc32_options(False)
    try:
        with storage.torch_crc32_off():
            pass
        assert not torch.serialization.get_crc32_options()
    finally:
        torch.serialization.set_crc32_options(True)
    # Restored after a failing write too.
    with pytest.raises(RuntimeError), storage.torch_crc32_off():
        raise RuntimeError("disk full")
    assert torch.serialization.get_crc32_options()
