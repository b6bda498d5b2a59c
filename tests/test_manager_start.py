"""A CheckpointManager whose start fails after it took the lease gives back everything it started: the
lease and its heartbeat thread, the writer process, the groups. A second manager on the same root then
opens at once (it used to find the root held by this live process and open read-only)."""

from __future__ import annotations

import signal
import threading
import warnings
from pathlib import Path

import psutil
import pytest
import torch

import safepoint
from safepoint.preempt.preemption import Preemption
from safepoint.tiers.base import ReadOnlyRootWarning


def _live_children() -> list[psutil.Process]:
    return [c for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]


def test_a_start_that_fails_after_the_lease_gives_everything_back(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The constructor's last step (starting the preemption sources, after the lease, the heartbeat and the
    # writer process) fails as a thread start does when the process is out of threads.
    def out_of_threads(self: object) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(Preemption, "start", out_of_threads)
    threads_before, children_before = set(threading.enumerate()), _live_children()
    with pytest.raises(RuntimeError, match="can't start new thread"):
        safepoint.CheckpointManager(  # "process": started with the manager ("auto" waits for a large state)
            root,
            async_save=True,
            writer=safepoint.WriterOptions(async_writer="process"),
            preemption=safepoint.PreemptionOptions(signals=[signal.SIGUSR1]),
        )
    left = [t.name for t in threading.enumerate() if t not in threads_before]
    assert left == [], f"threads left running: {left}"
    assert _live_children() == children_before, "the writer process was left running"
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReadOnlyRootWarning)  # the lease was given back: not read-only
        with safepoint.CheckpointManager(root) as mgr:
            assert mgr.save(1, safepoint.TrainState(model=torch.nn.Linear(2, 2))) is not None
