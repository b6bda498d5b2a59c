"""The warnings a restore gives the user point at the user's own line (``mgr.restore(state)``), not at an
internal line of safepoint: Python prints that line under the warning, and a newcomer read
``resume.py:135: CheckpointWarning ... manifest = load()`` as a crash inside the library."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

import safepoint


def _restore_warnings(root: Path, state: safepoint.TrainState) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with safepoint.CheckpointManager(root) as mgr:
            mgr.restore(state)
    return [w for w in caught if issubclass(w.category, safepoint.CheckpointWarning)]


def test_the_fallback_warning_points_at_the_restore_call(tmp_path: Path) -> None:
    state = safepoint.TrainState(model=torch.nn.Linear(4, 4), rng=False)
    with safepoint.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
    data = next((tmp_path / "step-2").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(raw)
    caught = _restore_warnings(tmp_path, state)
    assert [str(w.message) for w in caught if "skipping corrupt checkpoint: step 2" in str(w.message)]
    assert {w.filename for w in caught} == {__file__}


def test_a_missing_section_warning_points_at_the_restore_call(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    with safepoint.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, safepoint.TrainState(model=model, rng=False))
    teacher = torch.nn.Linear(4, 4)
    caught = _restore_warnings(
        tmp_path, safepoint.TrainState(model=model, modules={"teacher": teacher}, rng=False)
    )
    assert [str(w.message) for w in caught if "'modules.teacher'" in str(w.message)]
    assert {w.filename for w in caught} == {__file__}
