"""Per-rank sections (RNG, data position, extra) live in one file per rank, out of DCP's ``.metadata``
(store/rank_state.py); checkpoints that hold them inside ``.metadata`` still restore."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import safepoint
import safepoint.store.rank_state as rank_state
from safepoint.store.manifest import Manifest
from safepoint.store.storage import read_metadata_file


def _state(seed: int, note: str) -> tuple[safepoint.TrainState, torch.nn.Linear, dict[str, object]]:
    torch.manual_seed(seed)
    model, extra = torch.nn.Linear(4, 4), {"note": note, "seen": torch.arange(3) + seed}
    return safepoint.TrainState(model=model, rng=True, extra=extra), model, extra


def _round_trip(root: Path) -> None:
    state, model, _ = _state(1, "saved")
    random.seed(11)
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(5, state)
    expected_draw = random.random()
    state2, model2, extra2 = _state(2, "fresh")
    random.seed(99)
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(state2) == 5
    assert random.random() == expected_draw  # the RNG came back
    assert extra2["note"] == "saved" and torch.equal(extra2["seen"], torch.arange(3) + 1)  # type: ignore[arg-type]
    assert torch.equal(model2.weight, model.weight)


def test_per_rank_sections_are_in_a_rank_file_listed_in_the_manifest_not_in_metadata(root: Path) -> None:
    _round_trip(root)
    step = root / "step-5"
    keys = read_metadata_file(step / ".metadata").state_dict_metadata
    assert "model.weight" in keys
    assert not [k for k in keys if k.startswith(("rng.", "extra.", "dataloader."))], sorted(keys)
    manifest = Manifest.from_json((step / "safepoint.json").read_bytes())
    assert manifest.files["rank-0.state"].size == (step / "rank-0.state").stat().st_size
    # The DCP checkpoint stays readable by plain dcp.load for the model.
    sd = {"model": torch.nn.Linear(4, 4).state_dict()}
    dcp.load(sd, checkpoint_id=str(step), no_dist=True)
    saved, _, _ = _state(1, "")
    assert torch.equal(sd["model"]["weight"], saved.model.weight)  # type: ignore[union-attr]


def test_checkpoints_with_per_rank_sections_inside_metadata_still_restore(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The format before rank files: every section in DCP's state dict (so in .metadata).
    monkeypatch.setattr(rank_state, "split_sections", lambda sd: (sd, {}))
    state, _, _ = _state(1, "saved")
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(5, state)
    monkeypatch.undo()
    keys = read_metadata_file(root / "step-5" / ".metadata").state_dict_metadata
    assert "extra.rank_0.note" in keys and not (root / "step-5" / "rank-0.state").exists()
    state2, _, extra2 = _state(2, "fresh")
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(state2) == 5
    assert extra2["note"] == "saved"


def test_a_damaged_rank_file_is_never_loaded(root: Path) -> None:
    _round_trip(root)
    f = root / "step-5" / "rank-0.state"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))
    state2, _, extra2 = _state(2, "fresh")
    with safepoint.CheckpointManager(root) as mgr:
        with pytest.raises(safepoint.CorruptCheckpointError, match="rank-0.state"):
            mgr.restore(state2, step=5)
    assert extra2["note"] == "fresh"
