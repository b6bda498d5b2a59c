"""The loop's save first (save/foreground.py): while the training thread writes a save, background save work
waits at its pause points instead of competing with it for the GIL; and the writer process takes its lower
priority before it imports torch (save/writer_process.py's launch line).

Issue 27: with ``if_busy="auto"`` a save written beside the one in flight blocked up to ~2.8x a sync save
(docs/benchmarks.md, round 6). Nothing here times anything: a waiting thread is seen waiting (parked on
the gate, its save not committed), and the priority is read by the child itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import safepoint
from safepoint.save.foreground import ForegroundGate
from safepoint.save.writer_process import _LAUNCH

_DEADLINE_S = 120.0  # only bounds a failure: a working gate is reached at once


def _until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + _DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


def test_other_threads_wait_while_it_is_held_and_its_holder_never_does() -> None:
    gate = ForegroundGate()
    passed = threading.Event()

    def background() -> None:
        gate.pause()
        passed.set()

    with gate.foreground():
        gate.pause()  # the holder passes its own pause points (an inline retention pass)
        with gate.foreground():  # nested: still held when the inner block ends
            pass
        t = threading.Thread(target=background, daemon=True)
        t.start()
        _until(lambda: gate.parked == 1, "the background thread parked")
        assert not passed.is_set()  # parked on the gate: it cannot have passed
        with gate.opened():  # the holder waiting for background work lets it run
            t.join(_DEADLINE_S)
        assert passed.is_set()
        t = threading.Thread(target=background, daemon=True)
        passed.clear()
        t.start()
        _until(lambda: gate.parked == 2, "parked again once the wait was over")
        assert not passed.is_set()
    t.join(_DEADLINE_S)
    assert passed.is_set()
    with pytest.raises(RuntimeError), gate.foreground():
        raise RuntimeError("the save failed")
    gate.pause()  # released on any exit: this thread is not the holder and does not wait
    assert gate.held == 3 and gate.parked == 2


def test_a_save_beside_the_one_in_flight_is_written_while_that_one_waits(tmp_path: Path) -> None:
    """The training thread holds the gate (as it does during every async save call): the async save of
    step 1 stays in flight, its writer thread parked; a save of step 2 comes, is written beside it
    (if_busy="auto") and commits while step 1's thread still waits; step 1 commits after, both intact."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    state = safepoint.TrainState(model=model, rng=False)
    writer = safepoint.WriterOptions(async_writer="thread", if_busy="auto")
    with safepoint.CheckpointManager(tmp_path / "r", async_save=True, writer=writer) as mgr:
        gate = mgr._writer.gate
        with gate.foreground():
            mgr.save(1, state)
            first = {k: v.clone() for k, v in model.state_dict().items()}
            _until(lambda: gate.parked >= 1, "step 1's writer thread parked")
            with torch.no_grad():
                model.weight.add_(1.0)
            info = mgr.save(2, state)
            assert info is not None and info.step == 2
            assert mgr._writer.synced == 1 and mgr._writer.busy  # written beside step 1, still in flight
            assert [c.step for c in mgr.list()] == [2]  # step 1's thread waited all along
        mgr.wait()
        assert [c.step for c in mgr.list()] == [1, 2]
        second = {k: v.clone() for k, v in model.state_dict().items()}
        for step, want in ((1, first), (2, second)):
            with torch.no_grad():
                model.weight.zero_()
                model.bias.zero_()
            assert mgr.restore(state, step=step) == step
            for k, v in model.state_dict().items():
                assert torch.equal(v, want[k]), (step, k)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-process nice as the writer sets it")
def test_the_writer_process_is_nicer_before_it_imports_anything(tmp_path: Path) -> None:
    """The launch line sets the writer's priority before its first import (importing torch is seconds of a
    core: at the rank's priority it took the CPU from training while the first saves ran)."""
    (tmp_path / "nice_probe.py").write_text(
        "import os\nAT_IMPORT = os.getpriority(os.PRIO_PROCESS, 0)\n"
        "def main(argv):\n    print(AT_IMPORT)\n    return 0\n"
    )
    want = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 5)
    launch = _LAUNCH.format(module="nice_probe")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    args = [sys.executable, "-c", launch, "0", str(os.getpid()), str(want)]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=_DEADLINE_S, check=True)
    assert int(out.stdout) == want
