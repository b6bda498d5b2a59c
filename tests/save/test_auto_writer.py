"""async_writer="auto": the writer thread while the state is small, a writer process once it pays off.

Every test but one stays in this process (the default suite's time bar): a small state starts no process,
whatever the saves (async, beside the one in flight, the emergency save of a real SIGTERM); the state is
judged again when it grows; ``"thread"`` never starts one. The one real writer process: a state that grows
past ``AUTO_PROCESS_MIN_ITEMS`` starts exactly one, from the thread that calls ``save()``, and it then
writes the saves.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import safepoint
from safepoint.save import writer_choice, writer_process
from safepoint.save.staging import Stager
from tests.helpers.train import Setup, assert_bitwise_equal


def _params(n: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of ``n`` tiny parameters and its Adam, not stepped yet (no optimizer state)."""
    m = torch.nn.Module()
    m.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.full((4,), float(i))) for i in range(n)])
    return m, torch.optim.Adam(m.parameters(), lr=1e-3)


def _step(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = sum(p.sum() for p in m.parameters())
    assert isinstance(loss, torch.Tensor)
    opt.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()


def test_a_small_state_starts_no_writer_process(root: Path) -> None:
    """The default writer with the small state of a small job: staged privately and written by the thread,
    over saves of a state that grew (optimizer state after the first save)."""
    s = Setup()
    writer = safepoint.WriterOptions(if_busy="wait")  # every save staged (none beside the one in flight)
    with safepoint.CheckpointManager(root, async_save=True, save_every_steps=1, writer=writer) as mgr:
        assert mgr._writers._auto and mgr._process is None  # "auto" here: Linux, a local root
        mgr.save(1, s.state())  # before the first step: no optimizer state yet
        for step in range(2, 7):
            s.step()
            mgr.maybe_save(step, s.state())
        mgr.wait()
        assert mgr._process is None and mgr._stager.arena is None  # no shared segment either
        assert mgr._stager.allocations == 2  # judged twice: the first state, and the one with Adam's state
        assert [c.step for c in mgr.list()] == [1, 2, 3, 4, 5, 6]
    fresh = Setup(seed=1)
    with safepoint.CheckpointManager(root) as again:
        assert again.restore(fresh.state()) == 6
    assert_bitwise_equal(s.snapshot(), fresh.snapshot())


def test_the_emergency_save_of_a_sigterm_starts_no_writer_process(root: Path) -> None:
    s = Setup()
    notices = safepoint.PreemptionOptions(signals=(signal.SIGTERM,))
    mgr = safepoint.CheckpointManager(root, async_save=True, save_every_steps=2, preemption=notices)
    try:
        for step in range(1, 5):
            s.step()
            mgr.maybe_save(step, s.state())
        s.step()
        os.kill(os.getpid(), signal.SIGTERM)  # a real signal, to the manager's handler
        with pytest.raises(safepoint.Preempted) as info:
            mgr.maybe_save(5, s.state())
        assert info.value.saved_step == 5
        assert mgr._process is None and mgr._stager.arena is None
    finally:
        mgr.close()
    with safepoint.CheckpointManager(root) as again:
        assert [c.step for c in again.list()] == [2, 4, 5]


def test_the_state_is_judged_at_each_new_buffer_set_with_its_items_and_bytes() -> None:
    """Stager's ``share_from``: asked once per buffer set (a state that keeps its shape is not measured
    again), with the state's tensor items and bytes; True moves the staging to a shared segment."""
    m, opt = _params(3)
    asked: list[tuple[int, int]] = []

    def share_from(items: int, nbytes: int) -> bool:
        asked.append((items, nbytes))
        return items > 6  # the state with Adam's moments

    stager = Stager(share_from=share_from)
    try:
        state = safepoint.TrainState(model=m, optimizer=opt, rng=False)
        stager.stage(state.capture(0))
        stager.stage(state.capture(0))
        assert asked == [(3, 48)] and stager.arena is None  # 3 parameters of 4 floats; private buffers
        _step(m, opt)  # Adam's state appears: 3 x (exp_avg, exp_avg_sq, step)
        staged = stager.stage(state.capture(0))
        assert asked[1:] == [(12, 48 * 3 + 3 * 4)] and stager.nbytes == asked[1][1]
        assert stager.arena is not None and stager.allocations == 2  # now in one shared segment
        ptr = staged["model"]["ps.0"].data_ptr()
        assert stager.arena.offset_of(ptr, 16) is not None
        stager.stage(state.capture(0))
        assert len(asked) == 2  # shared from now on: never asked again
    finally:
        stager.release()


def test_thread_never_starts_a_writer_process(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer_choice, "AUTO_PROCESS_MIN_ITEMS", 1)  # any state would start one under "auto"
    s = Setup()
    writer = safepoint.WriterOptions(async_writer="thread")
    with safepoint.CheckpointManager(root, async_save=True, writer=writer) as mgr:
        s.step()
        mgr.save(1, s.state())
        mgr.wait()
        assert mgr._process is None and mgr._stager.arena is None


def test_the_threshold_is_the_item_count() -> None:
    assert not writer_choice.process_pays_off(writer_choice.AUTO_PROCESS_MIN_ITEMS - 1)
    assert writer_choice.process_pays_off(writer_choice.AUTO_PROCESS_MIN_ITEMS)


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the process writer is Linux-only")
def test_a_state_grown_past_the_threshold_starts_one_process_that_then_writes(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below the threshold before the first optimizer step (model only), above it after (Adam's moments
    and steps): the save that crosses it starts exactly one writer process, from the thread calling
    save(), and moves the staging into the shared segment; every later save keeps both, and once the
    process is ready it writes them."""
    # A small threshold for a cheap state (saves of 1,000 tiny tensors take seconds on a loaded machine).
    monkeypatch.setattr(writer_choice, "AUTO_PROCESS_MIN_ITEMS", 10)
    n = 4  # n items, then 4 n with Adam's state
    m, opt = _params(n)
    starters: list[threading.Thread] = []
    real_start = writer_process.WriterProcess._start

    def start(self: writer_process.WriterProcess) -> None:
        starters.append(threading.current_thread())
        real_start(self)

    monkeypatch.setattr(writer_process.WriterProcess, "_start", start)
    state = safepoint.TrainState(model=m, optimizer=opt, rng=False)
    writer = safepoint.WriterOptions(if_busy="wait")  # every save through the background writer
    with safepoint.CheckpointManager(root, async_save=True, writer=writer) as mgr:
        mgr.save(1, state)
        mgr.wait()
        assert mgr._process is None and mgr._stager.arena is None
        _step(m, opt)
        mgr.save(2, state)  # crosses: the process starts; this save is staged in the shared segment
        process = mgr._process
        assert process is not None and process.started == 1 and mgr._stager.arena is not None
        assert starters == [threading.current_thread()]  # the training thread, not the writer thread
        mgr.wait()
        process.wait_ready()
        for step in (3, 4):
            _step(m, opt)
            mgr.save(step, state)
            mgr.wait()
        assert mgr._process is process and process.started == 1 and len(starters) == 1
        # The process wrote steps 3 and 4 (step 2 too if it got ready first; else the thread did).
        assert process.writes >= 2 and process.writes + process.thread_writes == 3
        assert mgr._stager.allocations == 2
        expected: dict[str, Any] = {k: v.clone() for k, v in m.state_dict().items()}
    fresh, fresh_opt = _params(n)
    with safepoint.CheckpointManager(root) as again:
        assert again.restore(safepoint.TrainState(model=fresh, optimizer=fresh_opt, rng=False)) == 4
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())
