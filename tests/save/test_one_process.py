"""A save with no process group calls DCP's planner and storage-writer steps itself, without
``dcp.save``'s plumbing for many ranks (save/one_process.py): the checkpoint is DCP's, file for file and
byte for byte, plain ``dcp.load`` reads it, ``.metadata`` is written in place in the pending directory
(store/storage.py ``SafepointWriter.finish``), and failures are reported as DCP's wrapper reports them."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import safepoint
from safepoint.save import plan_reuse, saver
from safepoint.save.one_process import save_one_process
from safepoint.store import storage
from safepoint.store.rank_state import split_sections
from safepoint.store.storage import read_metadata_file


def _state() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


@pytest.fixture
def no_dcp_save(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("dcp.save called for a save with no process group")

    monkeypatch.setattr(saver, "dcp_save", refuse)


def test_the_files_are_those_dcp_save_writes_through_the_same_writer(tmp_path: Path) -> None:
    model, opt = _state()
    sd, _ = split_sections(safepoint.TrainState(model=model, optimizer=opt).capture(0))
    written = {}
    for name, run in (("dcp", None), ("direct", save_one_process)):
        pending = tmp_path / name / ".pending" / "step-1-x"
        pending.parent.mkdir(parents=True)
        writer = storage.SafepointWriter(pending)
        if run is None:
            dcp.save(sd, storage_writer=writer, planner=DefaultSavePlanner(), no_dist=True)
        else:
            run(sd, writer, DefaultSavePlanner())
        written[name] = {p.name: p.read_bytes() for p in pending.iterdir() if p.name != ".metadata"}
        written[name][".metadata"] = read_metadata_file(pending / ".metadata")
        assert writer.written_files().keys() == {p.name for p in pending.iterdir()}
    a, b = written["dcp"].pop(".metadata"), written["direct"].pop(".metadata")
    assert written["dcp"] == written["direct"] and list(written["dcp"]) == ["__0_0.distcp"]
    assert a.state_dict_metadata == b.state_dict_metadata
    assert a.storage_data == b.storage_data and a.planner_data == b.planner_data and a.version == b.version
    assert a.storage_meta is not None and b.storage_meta is not None  # the save's own path and id
    assert Path(b.storage_meta.checkpoint_id).name == "step-1-x"


def test_a_save_reads_back_through_plain_dcp_without_dcp_save(root: Path, no_dcp_save: None) -> None:
    model, opt = _state()
    state = safepoint.TrainState(model=model, optimizer=opt)
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, state)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # the second save (plans cached) writes new bytes
        mgr.save(2, state)
    assert not any(p.name.endswith(".tmp") for p in (root / "step-2").iterdir())
    fresh = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    target = {"model": {k: torch.zeros_like(v) for k, v in fresh.state_dict().items()}}
    dcp.load(target, checkpoint_id=str(root / "step-2"), no_dist=True)
    for k, v in model.state_dict().items():
        assert torch.equal(target["model"][k], v), k


def test_metadata_is_written_in_place_in_the_pending_directory(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pending directory is invisible until the commit: .metadata needs no temporary file and rename of
    # its own. Nothing is renamed inside it, and the file is DCP's (read by plain dcp.load).
    def no_rename(self: Any, path: Any, new_path: Any) -> None:
        raise AssertionError(f"renamed {path} -> {new_path}")

    monkeypatch.setattr(storage._ChecksummingFileSystem, "rename", no_rename)
    model, _ = _state()
    with safepoint.CheckpointManager(root) as mgr:
        for step in (1, 2):
            mgr.save(step, safepoint.TrainState(model=model, rng=False))
    target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(target, checkpoint_id=str(root / "step-2"), no_dist=True)
    assert all(torch.equal(target["model"][k], v) for k, v in model.state_dict().items())
    restored, _ = _state()
    with torch.no_grad():
        for p in restored.parameters():
            p.zero_()
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(model=restored, rng=False)) == 2
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in model.state_dict().items())


def test_a_planning_failure_is_a_save_error_as_through_dcp(
    root: Path, monkeypatch: pytest.MonkeyPatch, no_dcp_save: None
) -> None:
    # DCP's wrapper turns any exception of a step into a CheckpointException: a TypeError in planning is a
    # failed save (SaveError, nothing committed), not a TypeError out of save().
    def broken(self: Any) -> Any:
        raise TypeError("a planner bug")

    model, _ = _state()
    with safepoint.CheckpointManager(root) as mgr:
        monkeypatch.setattr(plan_reuse.ReusingSavePlanner, "create_local_plan", broken)
        with pytest.raises(safepoint.SaveError, match="rank 0: TypeError: a planner bug"):
            mgr.save(1, safepoint.TrainState(model=model, rng=False))
        monkeypatch.undo()
        mgr.save(2, safepoint.TrainState(model=model, rng=False))
        assert [c.step for c in mgr.list()] == [2]


def test_a_write_failure_names_its_cause(
    root: Path, monkeypatch: pytest.MonkeyPatch, no_dcp_save: None
) -> None:
    def full(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    model, _ = _state()
    with safepoint.CheckpointManager(root) as mgr:
        monkeypatch.setattr(storage.SafepointWriter, "finish", full)
        with pytest.raises(safepoint.SaveError, match="rank 0: .*No space left on device"):
            mgr.save(1, safepoint.TrainState(model=model, rng=False))
        assert mgr.list() == []
    assert not list((root / ".pending").iterdir())
