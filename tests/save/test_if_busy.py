"""What a save does while the previous async save is still writing (``WriterOptions(if_busy=)``, docs/async.md).

The default, "auto": a save ``maybe_save`` makes due never waits for the write in flight (it is skipped, and
counted), so a loop that saves more often than a save is written is never blocked longer than the copy
into the staging buffers; an explicit ``save()`` waits, so a final save is never lost. The write in flight
is held in flight for real: the writer process is stopped with SIGSTOP (nothing it does can finish) and
continued with SIGCONT.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import safepoint

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the process writer is Linux-only")


def _state() -> safepoint.TrainState:
    model = nn.Linear(8, 4)
    return safepoint.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters()), rng=False)


def _in_thread(fn: object) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)  # type: ignore[operator]
    t.start()
    return t, out


def test_default_maybe_save_skips_instead_of_waiting_and_explicit_save_waits(root: Path) -> None:
    assert safepoint.WriterOptions().if_busy == "auto"
    state = _state()
    writer = safepoint.WriterOptions(async_writer="process")
    with safepoint.CheckpointManager(root, async_save=True, writer=writer, save_every_steps=1) as mgr:
        assert mgr._process is not None
        mgr._process.wait_ready()
        assert mgr.maybe_save(1, state) is True
        mgr.wait()  # the staging buffers exist now: the next saves only copy into them
        pid = mgr._process.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # step 2's write cannot finish until SIGCONT
        try:
            assert mgr.maybe_save(2, state) is True  # staged, handed to the stopped process
            assert mgr._writer.busy
            # Due, and the previous save in flight: maybe_save returns without waiting for it (were it
            # waiting, it could not return while the writer is stopped).
            t, out = _in_thread(lambda: mgr.maybe_save(3, state))
            t.join(timeout=120)
            assert not t.is_alive() and out == [False]
            assert mgr._writer.skipped == 1 and mgr._writer.waited == 0 and mgr._writer.busy
            # An explicit save() of a step waits for the write in flight (and is then written).
            t, out = _in_thread(lambda: mgr.save(4, state))
            t.join(timeout=0.5)
            assert t.is_alive(), "save() must wait for the write in flight under if_busy='auto'"
        finally:
            os.kill(pid, signal.SIGCONT)
        t.join(timeout=120)
        assert not t.is_alive() and out == [None]
        assert mgr._writer.waited == 1 and mgr._writer.skipped == 1
        mgr.wait()
        assert [c.step for c in mgr.list()] == [1, 2, 4]


def test_wait_policy_makes_maybe_save_wait(root: Path) -> None:
    state = _state()
    writer = safepoint.WriterOptions(async_writer="process", if_busy="wait")
    with safepoint.CheckpointManager(root, async_save=True, writer=writer, save_every_steps=1) as mgr:
        assert mgr._process is not None
        mgr._process.wait_ready()
        mgr.maybe_save(1, state)
        mgr.wait()
        pid = mgr._process.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            mgr.maybe_save(2, state)
            t, out = _in_thread(lambda: mgr.maybe_save(3, state))
            t.join(timeout=0.5)
            assert t.is_alive(), "if_busy='wait': maybe_save waits for the write in flight"
        finally:
            os.kill(pid, signal.SIGCONT)
        t.join(timeout=120)
        assert out == [True] and mgr._writer.waited == 1 and mgr._writer.skipped == 0
        mgr.wait()
        assert [c.step for c in mgr.list()] == [1, 2, 3]
