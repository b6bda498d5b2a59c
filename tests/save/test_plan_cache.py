"""DCP's plan cache is class-level and never emptied by DCP: each saver keeps its plans under its own key,
and they must go with the saver. The 500-cycle soak (tests/torture/test_torture_soak.py, slow) found RSS
growing ~28 KB per manager in a process that opened one manager per cycle."""

from __future__ import annotations

import gc
from pathlib import Path

import torch
from torch.distributed.checkpoint.planner import SavePlanner

import safepoint


def _cached_keys() -> set[str]:
    caches = (SavePlanner._cached_save_plan, SavePlanner._cached_all_plans, SavePlanner._cached_metadata)
    return {k for cache in caches for k in cache if k.startswith("safepoint-")}


def test_a_closed_managers_plans_leave_dcps_cache(root: Path) -> None:
    state = safepoint.TrainState(model=torch.nn.Linear(4, 4))
    mine: set[str] = set()
    for step in (1, 2, 3):
        before = _cached_keys()
        with safepoint.CheckpointManager(root) as mgr:
            mgr.save(step, state)
            added = _cached_keys() - before
            assert added  # plan caching is on while the manager lives
            mine |= added
        del mgr
        gc.collect()
    # (Other tests' managers in this process may go meanwhile too: only this test's keys are checked.)
    assert not _cached_keys() & mine
