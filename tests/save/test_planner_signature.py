"""The saver's planner keeps DCP's ``set_up_planner`` signature (issue 27's plan reuse subclasses it).

``dcp.save`` inspects the planner's ``set_up_planner`` for a ``storage_meta`` parameter; where it finds
none it warns on every save ("Please update your implementation") and calls it positionally as
``(state_dict, is_coordinator)``. The planner's ``*args`` pass-through then gave DCP's planner
``storage_meta=is_coordinator`` and ``is_coordinator=False`` on every rank, rank 0 included."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import safepoint


def test_a_save_under_a_process_group_hands_dcps_planner_its_own_arguments(
    tmp_path: Path, one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[object, bool]] = []
    real = DefaultSavePlanner.set_up_planner

    def spy(self: Any, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        seen.append((storage_meta, is_coordinator))
        real(self, state_dict, storage_meta, is_coordinator)

    monkeypatch.setattr(DefaultSavePlanner, "set_up_planner", spy)
    state = safepoint.TrainState(model=torch.nn.Linear(3, 3), rng=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
            assert mgr.comm.distributed  # DCP's own save path (one process without a group has its own)
            mgr.save(1, state)
            mgr.save(2, state)
    assert not [w for w in caught if "set_up_planner" in str(w.message)], [str(w.message) for w in caught]
    assert seen and all(coordinator is True for _, coordinator in seen), seen
    assert all(meta is None or not isinstance(meta, bool) for meta, _ in seen), seen
