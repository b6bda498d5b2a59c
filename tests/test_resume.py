"""CheckpointManager(resume=...): "required" fails naming the root and what it holds, "never" starts at step
0 and keeps what is there, and a new root is created with a warning (a typo'd root must not go unnoticed)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import safepoint
from tests.helpers.train import big_state


def _saved(root: Path, step: int, fill: float) -> None:
    _, st = big_state(1, fill=fill)
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(step, st)


def test_resume_required_names_the_root_and_what_it_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _, st = big_state(1)
    with safepoint.CheckpointManager("runs/oen", resume="required") as mgr:
        with pytest.raises(safepoint.CheckpointError) as err:
            mgr.restore(st)
    where = tmp_path / "runs" / "oen"
    assert str(err.value) == (
        f"resume='required' but there is no checkpoint to resume in {where} (empty, created just now)"
    )
    # A root that holds things, none of them a checkpoint: they are listed.
    (where / "notes.txt").write_text("x")
    (where / "step-7").mkdir()  # a save that never committed (no manifest)
    with safepoint.CheckpointManager(where, resume="required") as mgr:
        with pytest.raises(
            safepoint.CheckpointError, match=r"\(no checkpoint .*it holds: notes\.txt, step-7\)$"
        ):
            mgr.restore(st)
    # One whose only checkpoint is damaged: it says so (the fallback warned about the file).
    _saved(where, 5, 1.0)
    (data,) = (where / "step-5").glob("*.distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with safepoint.CheckpointManager(where, resume="required") as mgr:
        with (
            pytest.raises(safepoint.CheckpointError, match=r"no intact checkpoint among steps \[5\]"),
            pytest.warns(safepoint.CheckpointWarning, match="skipping corrupt checkpoint: step 5"),
        ):
            mgr.restore(st)
    # With a checkpoint, "required" restores it.
    _saved(where, 6, 6.0)
    m, st = big_state(1)
    with safepoint.CheckpointManager(where, resume="required") as mgr:
        assert mgr.restore(st) == 6
    assert torch.all(m.w == 6.0)


def test_resume_never_starts_at_step_0_and_keeps_the_checkpoints(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _saved(root, 5, 5.0)
    m, st = big_state(1, fill=-1.0)
    with caplog.at_level(logging.WARNING, logger="safepoint"):
        with safepoint.CheckpointManager(root, resume="never") as mgr:
            assert mgr.restore(st) == 0
            with pytest.raises(
                ValueError, match=r"restore\(step=5\) loads a checkpoint, but .* resume='never'"
            ):
                mgr.restore(st, step=5)
            assert [c.step for c in mgr.list()] == [5]  # kept
    assert torch.all(m.w == -1.0), "resume='never' loaded a checkpoint"
    assert f"the checkpoint in {root} (step 5) is kept, not loaded" in caplog.text
    with safepoint.CheckpointManager(root) as mgr:  # "auto" (the default) still finds it
        assert mgr.restore(st) == 5


def test_a_new_root_is_created_with_a_warning_naming_its_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="safepoint"):
        with safepoint.CheckpointManager("runs/oen") as mgr:
            assert mgr.restore(big_state(1)[1]) == 0
    assert f"creating a new checkpoint root {tmp_path / 'runs' / 'oen'}: a fresh run" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="safepoint"):
        with safepoint.CheckpointManager("runs/oen"):
            pass
    assert "creating a new checkpoint root" not in caplog.text  # it exists now


def test_resume_is_checked(root: Path) -> None:
    with pytest.raises(ValueError, match="resume must be 'auto', 'required' or 'never', got 'yes'"):
        safepoint.CheckpointManager(root, resume="yes")
    assert not root.exists()  # checked before anything was created
