"""Corruption of the newest checkpoint: detected, warned about (naming step, file, reason), and restore
falls back to the previous intact checkpoint."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import safepoint
from tests.helpers.train import Setup, assert_bitwise_equal


def _two_checkpoints(root: Path) -> tuple[Setup, dict[str, torch.Tensor]]:
    s = Setup()
    with safepoint.CheckpointManager(root) as mgr:
        s.step()
        mgr.save(1, s.state())
        at1 = s.snapshot()
        s.step()
        mgr.save(2, s.state())
    return s, at1


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-7])


def _zero(p: Path) -> None:
    p.write_bytes(b"\0" * p.stat().st_size)


def _delete(p: Path) -> None:
    p.unlink()


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "flip": (_flip, "crc32c"),
    "truncate": (_truncate, "size"),
    "zero": (_zero, "crc32c"),
    "delete": (_delete, "missing"),
}


@pytest.mark.parametrize("fname", ["__0_0.distcp", ".metadata"])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_data_file_falls_back(root: Path, fname: str, damage: str) -> None:
    _, at1 = _two_checkpoints(root)
    fn, reason = DAMAGE[damage]
    fn(root / "step-2" / fname)
    s2 = Setup(seed=9)
    with safepoint.CheckpointManager(root) as mgr:
        with pytest.warns(safepoint.CheckpointWarning, match=rf"step 2, file '{fname}'.*{reason}"):
            assert mgr.restore(s2.state()) == 1
    assert_bitwise_equal(at1, s2.snapshot())


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.write_text("{not json"),
        lambda p: p.write_text(p.read_text().replace('"step": 2', '"step": 3')),  # parses, self-crc fails
        lambda p: p.write_bytes(p.read_bytes()[:40]),
        lambda p: p.write_text(json.dumps({"format": "other"})),
    ],
    ids=["garbage", "edited", "truncated", "foreign"],
)
def test_broken_manifest_falls_back(root: Path, damage: Callable[[Path], None]) -> None:
    _, at1 = _two_checkpoints(root)
    damage(root / "step-2" / "safepoint.json")
    s2 = Setup(seed=9)
    with safepoint.CheckpointManager(root) as mgr:
        with pytest.warns(safepoint.CheckpointWarning, match=r"step 2, file 'safepoint.json'"):
            assert mgr.restore(s2.state()) == 1
    assert_bitwise_equal(at1, s2.snapshot())


def test_missing_manifest_means_not_a_checkpoint(root: Path) -> None:
    _two_checkpoints(root)
    (root / "step-2" / "safepoint.json").unlink()
    with safepoint.CheckpointManager(root) as mgr:
        assert [c.step for c in mgr.list()] == [1]
        assert mgr.restore(Setup().state()) == 1


def test_all_corrupt_returns_zero_and_explicit_step_raises(root: Path) -> None:
    _two_checkpoints(root)
    _flip(root / "step-1" / "__0_0.distcp")
    _flip(root / "step-2" / "__0_0.distcp")
    with safepoint.CheckpointManager(root) as mgr:
        with pytest.warns(safepoint.CheckpointWarning):
            assert mgr.restore(Setup().state()) == 0
        with pytest.raises(safepoint.CorruptCheckpointError, match="step 2, file '__0_0.distcp': crc32c"):
            mgr.restore(Setup().state(), step=2)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_corrupt_tensor_bytes_never_reach_the_live_state(root: Path, where: str) -> None:
    """Tensors are read straight into the live model and optimizer: a checkpoint whose data is damaged must
    be rejected before any byte is read into them (verify first, then load)."""
    from safepoint.store.storage import read_metadata_file

    s = Setup()
    with safepoint.CheckpointManager(root) as mgr:
        s.step()
        mgr.save(1, s.state())
    step_dir = root / "step-1"
    md = read_metadata_file(step_dir / ".metadata")
    tensors = {k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    items = sorted((v for k, v in md.storage_data.items() if k.fqn in tensors), key=lambda i: i.offset)
    item = {"first": items[0], "middle": items[len(items) // 2], "last": items[-1]}[where]
    path = step_dir / item.relative_path
    data = bytearray(path.read_bytes())
    # Flip a byte inside the item's tensor data record: the bytes the fast path reads into the model.
    blob = io.BytesIO(bytes(data[item.offset : item.offset + item.length]))
    record = torch._C.PyTorchFileReader(blob).get_record_offset("data/0")  # type: ignore[attr-defined]
    data[item.offset + record] ^= 0x10
    path.write_bytes(bytes(data))

    s2 = Setup(seed=9)
    before = s2.snapshot()
    with safepoint.CheckpointManager(root) as mgr:
        with pytest.warns(safepoint.CheckpointWarning, match="crc32c"):
            assert mgr.restore(s2.state()) == 0
        with pytest.raises(safepoint.CorruptCheckpointError, match="crc32c"):
            mgr.restore(s2.state(), step=1)
    assert_bitwise_equal(before, s2.snapshot())
