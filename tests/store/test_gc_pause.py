"""The cyclic GC is held off during a save's and a restore's per-item work (store/gc_pause.py), and always
comes back as it was."""

from __future__ import annotations

import gc
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import safepoint
from safepoint.store.gc_pause import gc_paused


@pytest.fixture
def collections() -> Iterator[list[str]]:
    """Where each cyclic collection started inside DCP's save or load (its per-item work) ran."""
    seen: list[str] = []

    def cb(phase: str, info: dict[str, Any]) -> None:
        frame = sys._getframe(1)
        while phase == "start" and frame is not None:
            if f"torch{os.sep}distributed{os.sep}checkpoint" in frame.f_code.co_filename:
                seen.append(f"{frame.f_code.co_name} (generation {info['generation']})")
                return
            frame = frame.f_back  # type: ignore[assignment]

    gc.callbacks.append(cb)
    try:
        yield seen
    finally:
        gc.callbacks.remove(cb)


def test_pauses_nest_across_threads_and_survive_exceptions() -> None:
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        assert not gc.isenabled()
        raise RuntimeError
    assert gc.isenabled()
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with gc_paused():
            inside.set()
            release.wait()

    t = threading.Thread(target=other)
    t.start()
    inside.wait()
    with gc_paused():
        pass
    assert not gc.isenabled()  # the other thread's pause still holds
    release.set()
    t.join()
    assert gc.isenabled()


def test_a_program_that_runs_without_gc_keeps_it_off() -> None:
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_no_collection_runs_during_a_save_or_a_restore(root: Path, collections: list[str]) -> None:
    model = nn.ParameterList([nn.Parameter(torch.randn(4)) for _ in range(600)])
    opt = torch.optim.Adam(model.parameters())
    for p in model:
        p.grad = torch.ones_like(p)
    opt.step()
    state = safepoint.TrainState(model=model, optimizer=opt, rng=False)
    with safepoint.CheckpointManager(root) as mgr:
        collections.clear()
        mgr.save(1, state)  # ~2,400 items: thousands of allocations, many collections without the pause
        mgr.save(2, state)
        assert mgr.restore(state) == 2
        # (The first allocations after each pause may collect: outside DCP's work, and expected.)
        assert collections == []
    assert gc.isenabled()
