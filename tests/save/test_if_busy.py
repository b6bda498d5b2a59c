"""What a save does while the previous async save is still writing (``WriterOptions(if_busy=)``, docs/async.md).

"auto": the save is written synchronously at once, beside the write in flight, so the loop is blocked no
longer than a sync save and no save is lost. "wait" (the default) waits for the write; "skip" saves nothing.
The write in flight is held in flight for real: the writer process is stopped with SIGSTOP (nothing it does
can finish meanwhile) and continued with SIGCONT. A call that waited for it could not return while it is
stopped: "does not wait" is shown by the call returning, not by a clock.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import safepoint

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the process writer is Linux-only")


def _state(model: nn.Module) -> safepoint.TrainState:
    return safepoint.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters()), rng=False)


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


@contextmanager
def _writer_stopped(mgr: safepoint.CheckpointManager) -> Iterator[None]:
    """The writer process stopped (SIGSTOP) for the block, once the staging buffers exist (a first save
    written), so that a save staged meanwhile stays in flight until the block ends."""
    assert mgr._process is not None
    pid = mgr._process.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _manager(root: Path, **writer: Any) -> safepoint.CheckpointManager:
    options = safepoint.WriterOptions(async_writer="process", **writer)
    mgr = safepoint.CheckpointManager(root, async_save=True, writer=options, save_every_steps=1)
    assert mgr._process is not None
    mgr._process.wait_ready()
    return mgr


def test_auto_saves_synchronously_beside_the_write_in_flight(root: Path) -> None:
    assert safepoint.WriterOptions().if_busy == "wait"  # "auto" commits out of step order: an option
    model = nn.Linear(8, 4)
    state = _state(model)
    with _manager(root, if_busy="auto") as mgr:
        assert mgr.maybe_save(1, state) is True
        mgr.wait()  # the staging buffers exist now: the next save only copies into them
        with _writer_stopped(mgr):
            assert mgr.maybe_save(2, state) is True  # staged, handed to the stopped writer process
            assert mgr._writer.busy
            with torch.no_grad():
                model.weight.fill_(3.0)  # step 3's state differs from step 2's staged copy
            # Neither call waits for step 2's write (it cannot finish while the process is stopped): each
            # is written synchronously and committed before it returns.
            t, out = _in_thread(lambda: (mgr.maybe_save(3, state), mgr.save(4, state)))
            t.join(timeout=300)
            assert not t.is_alive(), "a save waited for the write in flight under if_busy='auto'"
            assert out[0][0] is True and out[0][1] is not None and out[0][1].step == 4
            assert mgr._writer.synced == 2 and mgr._writer.waited == 0 and mgr._writer.skipped == 0
            assert mgr._writer.busy  # step 2 is still in flight
            assert [c.step for c in mgr.list()] == [1, 3, 4]
        mgr.wait()
        assert [c.step for c in mgr.list()] == [1, 2, 3, 4]
    for step, weight in ((2, None), (3, 3.0)):
        target = nn.Linear(8, 4)
        with safepoint.CheckpointManager(root) as mgr:
            assert mgr.restore(_state(target), step=step) == step
        if weight is None:
            assert not torch.all(target.weight == 3.0)  # the staged copy of step 2, taken before the fill
        else:
            assert torch.all(target.weight == weight)


@pytest.mark.slow  # a writer process each; tests/save/test_async.py has quicker checks of both policies
@pytest.mark.parametrize("policy", ["wait", "skip"])
def test_wait_waits_and_skip_skips(root: Path, policy: str) -> None:
    state = _state(nn.Linear(8, 4))
    with _manager(root, if_busy=policy) as mgr:
        mgr.maybe_save(1, state)
        mgr.wait()
        with _writer_stopped(mgr):
            mgr.maybe_save(2, state)
            t, out = _in_thread(lambda: mgr.maybe_save(3, state))
            t.join(timeout=0.5 if policy == "wait" else 300)
            # "wait" cannot return while the writer is stopped; "skip" returns at once, saving nothing.
            assert t.is_alive() is (policy == "wait")
        t.join(timeout=300)
        assert out == [policy == "wait"]
        assert (mgr._writer.waited, mgr._writer.skipped, mgr._writer.synced) == (
            (1, 0, 0) if policy == "wait" else (0, 1, 0)
        )
        mgr.wait()
        assert [c.step for c in mgr.list()] == ([1, 2, 3] if policy == "wait" else [1, 2])
