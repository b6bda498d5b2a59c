"""A CheckpointManager whose start fails after it took the lease gives back everything it started: the
lease and its heartbeat thread, the writer process, the groups. A second manager on the same root then
opens at once (it used to find the root held by this live process and open read-only)."""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path

import psutil
import pytest
import torch

import safepoint
from safepoint.tiers.base import ReadOnlyRootWarning


def _live_children() -> list[psutil.Process]:
    return [c for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]


def test_a_start_that_fails_after_the_lease_gives_everything_back(root: Path) -> None:
    # A real late failure: save_every_seconds="auto" reads ROOT/.attempts.json once the root is taken,
    # and an attempt whose "end" is no number stops the start (as any exception after the lease may).
    root.mkdir()
    attempts = [{"start": 1.0, "end": "soon", "outcome": "closed"}]
    (root / ".attempts.json").write_text(json.dumps({"version": 1, "attempts": attempts}))
    threads_before, children_before = set(threading.enumerate()), _live_children()
    with pytest.raises(ValueError, match="soon"):
        safepoint.CheckpointManager(root, save_every_seconds="auto", async_save=True)
    left = [t.name for t in threading.enumerate() if t not in threads_before]
    assert left == [], f"threads left running: {left}"
    assert _live_children() == children_before, "the writer process was left running"
    (root / ".attempts.json").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReadOnlyRootWarning)  # the lease was given back: not read-only
        with safepoint.CheckpointManager(root, save_every_seconds="auto") as mgr:
            assert mgr.save(1, safepoint.TrainState(model=torch.nn.Linear(2, 2))) is not None
