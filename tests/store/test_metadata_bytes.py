"""``.metadata`` with its unchanged head reused (store/metadata_bytes.py): every file is ``pickle.dumps`` of
the save's Metadata byte for byte, steady saves pickle only the tail, and a changed structure (a new
Metadata, or one whose plan fields were replaced) is never spliced onto a stale head."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

import safepoint
from safepoint.store import metadata_bytes
from safepoint.store.metadata_bytes import MetadataPickle


@pytest.fixture
def checked(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, bool]]:
    """Every ``MetadataPickle.dumps`` call compared with ``pickle.dumps`` of the same Metadata at that
    moment: (spliced, equal) per call."""
    calls: list[tuple[bool, bool]] = []
    real = MetadataPickle.dumps

    def dumps(self: MetadataPickle, md: Metadata) -> bytes:
        before = self.spliced
        data = real(self, md)
        calls.append((self.spliced > before, data == pickle.dumps(md)))
        return data

    monkeypatch.setattr(MetadataPickle, "dumps", dumps)
    return calls


def _model(width: int = 8) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _saved_md(root: Path) -> Metadata:
    model, opt = _model()
    with safepoint.CheckpointManager(root, keep=safepoint.Keep(last=1)) as mgr:
        mgr.save(1, safepoint.TrainState(model=model, optimizer=opt))
    return dcp.FileSystemReader(str(root / "step-1")).read_metadata()


def test_steady_saves_pickle_only_the_tail_and_write_pickle_dumps_bytes(
    root: Path, checked: list[tuple[bool, bool]]
) -> None:
    model, opt = _model()
    state = safepoint.TrainState(model=model, optimizer=opt)
    with safepoint.CheckpointManager(root, keep=safepoint.Keep(last=2)) as mgr:
        for step in range(1, 13):  # a physical full copy at the 10th (incremental full_every): new names
            with torch.no_grad():
                next(model.parameters()).add_(step)  # changed values: written, never linked
            opt.param_groups[0]["lr"] = 1e-3 * step
            mgr.save(step, state)
        spliced = mgr._saver._metadata_pickle.spliced
    assert all(equal for _, equal in checked), checked
    # The head is made at the second save of the same cached Metadata; every later one is spliced.
    assert [s for s, _ in checked] == [False, False] + [True] * 10
    assert spliced == 10
    got = dcp.FileSystemReader(str(root / "step-12")).read_metadata()
    loaded = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load({"model": loaded}, checkpoint_id=str(root / "step-12"))  # plain DCP reads it
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    assert got.storage_meta is not None and "step-12" in str(got.storage_meta.checkpoint_id)


def test_a_changed_structure_is_pickled_afresh(root: Path, checked: list[tuple[bool, bool]]) -> None:
    model, opt = _model(width=8)
    with safepoint.CheckpointManager(root, keep=safepoint.Keep(last=1)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, safepoint.TrainState(model=model, optimizer=opt))
        model, opt = _model(width=16)  # every shape of the hidden layer changed: a new plan
        for step in (4, 5, 6):
            mgr.save(step, safepoint.TrainState(model=model, optimizer=opt))
    assert all(equal for _, equal in checked), checked
    assert [s for s, _ in checked] == [False, False, True, False, False, True]
    md = dcp.FileSystemReader(str(root / "step-6")).read_metadata()
    assert tuple(md.state_dict_metadata["model.0.weight"].size) == (16, 4)  # type: ignore[union-attr]


def test_a_head_is_used_only_for_its_own_metadata_and_plan_fields(root: Path) -> None:
    md = _saved_md(root)
    cache = MetadataPickle()
    assert cache.dumps(md) == pickle.dumps(md)
    assert cache.dumps(md) == pickle.dumps(md) and cache.spliced == 0  # the head is made here
    md.storage_meta = StorageMeta(checkpoint_id="elsewhere", save_id="another")
    assert cache.dumps(md) == pickle.dumps(md) and cache.spliced == 1
    # An equal copy is another object: pickled whole (DCP makes a new Metadata for a new plan).
    other = copy.deepcopy(md)
    assert cache.dumps(other) == pickle.dumps(other) and cache.spliced == 1
    # The same object with its plan fields replaced (a different shape): never the stale head.
    changed: dict[str, Any] = dict(md.state_dict_metadata)
    first = next(iter(changed))
    changed[first] = copy.deepcopy(changed[first])
    changed[first].size = torch.Size([99])  # type: ignore[union-attr]
    md.state_dict_metadata = changed
    assert cache.dumps(md) == pickle.dumps(md) and cache.spliced == 1
    md.planner_data = dict(md.planner_data or {})
    assert cache.dumps(md) == pickle.dumps(md) and cache.spliced == 1


def test_a_metadata_over_one_frame_is_never_spliced(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    md = _saved_md(root)
    monkeypatch.setattr(metadata_bytes, "_FRAME_MAX", 64)  # as if its pickle spanned several frames
    cache = MetadataPickle()
    for _ in range(3):
        assert cache.dumps(md) == pickle.dumps(md)
    assert cache.spliced == 0 and cache._head is None
