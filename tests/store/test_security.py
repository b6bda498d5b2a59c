"""Loading never unpickles arbitrary objects: a crafted .metadata or non-tensor item runs no code, even
when its checksums were forged to match."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pytest
import torch

import safepoint
from safepoint.store.checksum import file_crc32c
from safepoint.store.manifest import MANIFEST_NAME, FileEntry, Manifest
from safepoint.store.reader import weights_only_load
from safepoint.store.storage import read_metadata_file


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        # Unpickling this writes a marker file: proof that code ran.
        return (Path.write_text, (str(self.marker), "pwned"))  # type: ignore[return-value]


def _reforge_manifest(step_dir: Path) -> None:
    """Recompute checksums so verification passes: only the loader's own defences remain."""
    m = Manifest.from_json((step_dir / MANIFEST_NAME).read_bytes())
    for name in m.files:
        size, crc = file_crc32c(step_dir / name)
        m.files[name] = FileEntry(size=size, crc32c=crc)
    (step_dir / MANIFEST_NAME).write_bytes(m.to_json())


def _save(root: Path, extra: dict[str, object] | None = None) -> Path:
    with safepoint.CheckpointManager(root) as mgr:
        return Path(mgr.save(1, safepoint.TrainState(model=torch.nn.Linear(3, 3), extra=extra)).path)


def test_malicious_metadata_pickle_runs_no_code(root: Path, tmp_path: Path) -> None:
    step_dir = _save(root)
    marker = tmp_path / "marker"
    md = read_metadata_file(step_dir / ".metadata")
    md.storage_meta = _Evil(marker)  # type: ignore[assignment]
    (step_dir / ".metadata").write_bytes(pickle.dumps(md))
    _reforge_manifest(step_dir)
    with safepoint.CheckpointManager(root) as mgr:
        with pytest.raises(safepoint.UnsafeCheckpointError, match=r"references pathlib\..*write_text"):
            mgr.restore(safepoint.TrainState(model=torch.nn.Linear(3, 3)))
    assert not marker.exists()


def _point_item_at_evil(step_dir: Path, fqn: str, marker: Path) -> None:
    """Append a malicious torch.save to the item's data file, point the item's metadata at it, and re-forge
    the manifest so the checksums pass: only the loader's own refusal stands between it and the code."""
    md = read_metadata_file(step_dir / ".metadata")
    [(idx, info)] = [(k, v) for k, v in md.storage_data.items() if k.fqn == fqn]
    data_path = step_dir / info.relative_path
    blob = bytearray(data_path.read_bytes())
    buf = io.BytesIO()
    torch.save(_Evil(marker), buf)
    evil = buf.getvalue()
    md.storage_data[idx] = type(info)(info.relative_path, len(blob), len(evil))
    blob += evil
    data_path.write_bytes(bytes(blob))
    (step_dir / ".metadata").write_bytes(pickle.dumps(md))
    _reforge_manifest(step_dir)


class _Noted:
    """A replicated Stateful whose state is one non-tensor item (kept in .metadata's items)."""

    def __init__(self, note: str) -> None:
        self.note = note

    def state_dict(self) -> dict[str, object]:
        return {"note": self.note}

    def load_state_dict(self, sd: dict[str, object]) -> None:
        self.note = str(sd["note"])


def test_malicious_non_tensor_item_runs_no_code(root: Path, tmp_path: Path) -> None:
    with safepoint.CheckpointManager(root) as mgr:
        state = safepoint.TrainState(model=torch.nn.Linear(3, 3), scheduler=_Noted("hello-hello-hello"))
        step_dir = Path(mgr.save(1, state).path)
    marker = tmp_path / "marker"
    _point_item_at_evil(step_dir, "scheduler.note", marker)
    with safepoint.CheckpointManager(root) as mgr:
        with pytest.raises(safepoint.UnsafeCheckpointError, match="scheduler.note.*not plain data"):
            mgr.restore(safepoint.TrainState(model=torch.nn.Linear(3, 3), scheduler=_Noted("")))
    assert not marker.exists()


def test_malicious_rank_file_runs_no_code(root: Path, tmp_path: Path) -> None:
    """Per-rank sections (RNG, data position, extra) live in rank-<r>.state (store/rank_state.py): a
    crafted pickle there, checksums re-forged, is refused by the weights-only rules and runs nothing."""
    step_dir = _save(root, extra={"note": "hello"})
    marker = tmp_path / "marker"
    buf = io.BytesIO()
    torch.save({"extra": {"note": _Evil(marker)}}, buf)
    (step_dir / "rank-0.state").write_bytes(buf.getvalue())
    _reforge_manifest(step_dir)
    with safepoint.CheckpointManager(root) as mgr:
        with pytest.raises(safepoint.UnsafeCheckpointError, match="rank-0.state.*weights-only"):
            mgr.restore(safepoint.TrainState(model=torch.nn.Linear(3, 3), extra={"note": ""}))
    assert not marker.exists()


def test_genuine_checkpoint_metadata_passes_the_allowlist(root: Path) -> None:
    step_dir = _save(root)
    md = read_metadata_file(step_dir / ".metadata")
    assert "model.weight" in md.state_dict_metadata


def test_malicious_tensor_item_runs_no_code(root: Path, tmp_path: Path) -> None:
    """A tensor item is read in place only when torch's weights-only unpickler accepts its description;
    a crafted one is refused on that path and on DCP's, and runs nothing."""
    step_dir = _save(root)
    marker = tmp_path / "marker"
    _point_item_at_evil(step_dir, "model.weight", marker)
    with safepoint.CheckpointManager(root) as mgr:
        with pytest.raises(safepoint.UnsafeCheckpointError, match=r"model\.weight.*not plain data"):
            mgr.restore(safepoint.TrainState(model=torch.nn.Linear(3, 3)))
    assert not marker.exists()


class _Shell:
    """A record calling ``os.system``: torch refuses it for its blocked module, in a message with no
    "WeightsUnpickler error:" line."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("true",))


def test_a_refused_blocked_global_is_named_in_one_line() -> None:
    """The why of the refusal names what the record tried to call (it said "Check the documentation of
    torch.load ...", torch's last line, for a global of a blocked module: os.system among them)."""
    buf = io.BytesIO()
    torch.save(_Shell(), buf)
    buf.seek(0)
    with pytest.raises(safepoint.UnsafeCheckpointError) as e:
        weights_only_load(buf, "extra.note")
    msg = str(e.value)
    assert "system" in msg and "Check the documentation" not in msg and "\n" not in msg, msg
