"""Retention's deletes run on rank 0's deleter thread (policy/retainer.py), off the save's critical path:
the default; ``ClusterOptions(background_deletes=False)`` runs them inside save().

Deletes are held with real blocking (an Event, a pipe) at the seam where they happen, never with sleeps:
a save returns and the next one commits while a delete is stuck, close() drains, a preemption notice and a
lost lease stop the deleter, a kill -9 mid-delete leaves a root the next manager cleans and restores from.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import torch

import safepoint
import safepoint.store.posix_layout as layout_module
from safepoint.errors import LeaseError
from safepoint.store.posix_layout import Layout
from tests.helpers import forkserver
from tests.helpers.example_runs import spawn_job

BACKGROUND = safepoint.ClusterOptions(background_deletes=True)


def _state(n: int) -> safepoint.TrainState:
    return safepoint.TrainState(rng=False, extra={"t": torch.full((64,), float(n))})


def _restored(root: Path, step: int | None = None) -> tuple[int, float]:
    state = _state(-1)
    with safepoint.CheckpointManager(root, cluster=BACKGROUND) as mgr:
        got = mgr.restore(state, step=step)
    return got, float(state.extra["t"][0])  # type: ignore[index]


@pytest.mark.parametrize("background", [None, True, False], ids=["default", "background", "inline"])
def test_deletes_run_on_the_deleter_thread_by_default_and_inline_on_request(
    root: Path, monkeypatch: pytest.MonkeyPatch, background: bool | None
) -> None:
    where: list[str] = []
    real = layout_module.remove_tree

    def remove_tree(path: Path) -> Any:
        where.append(threading.current_thread().name)
        return real(path)

    monkeypatch.setattr(layout_module, "remove_tree", remove_tree)
    kw: dict[str, Any] = {}
    if background is not None:
        kw["cluster"] = safepoint.ClusterOptions(background_deletes=background)
    with safepoint.CheckpointManager(root, keep=safepoint.Keep(last=1), **kw) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        if background is False:  # inline: done when save() returns
            assert where == ["MainThread"] and Layout(root).committed_steps() == [2]
        mgr.wait()  # drains the deleter
        assert where == ["MainThread" if background is False else "safepoint-retention"]
        assert [c.step for c in mgr.list()] == [2]
        assert not list((root / ".pending").iterdir())


class _HeldDelete:
    """Layout's remove_tree (the delete after the step left the listing), held until ``release``."""

    def __init__(self, real: Callable[[Any], Any], events: list[str]) -> None:
        self.real, self.events = real, events
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, path: Any) -> Any:
        self.started.set()
        assert self.release.wait(120), "the test never released the delete"
        result = self.real(path)
        self.events.append(f"deleted {Path(path).name.split('-')[1]}-{Path(path).name.split('-')[2]}")
        return result


def test_save_returns_and_the_next_commits_while_a_delete_is_stuck_and_close_drains(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    held = _HeldDelete(layout_module.remove_tree, events)
    monkeypatch.setattr(layout_module, "remove_tree", held)
    mgr = safepoint.CheckpointManager(root, keep=safepoint.Keep(last=1))  # deletes in the background
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))  # queues the deletion of step 1, which gets stuck
    assert held.started.wait(120)
    # Step 1 left the listing in one rename (so it never looks committed half-deleted); its files wait.
    assert Layout(root).committed_steps() == [2]
    assert [p.name.split("-")[:3] for p in (root / ".pending").iterdir()] == [["deleting", "step", "1"]]
    info = mgr.save(3, _state(3))  # returns, committed, with the delete of step 1 still stuck
    assert info is not None and info.step == 3
    assert Layout(root).committed_steps() == [2, 3]

    def close() -> None:
        mgr.close()
        events.append("closed")

    closer = threading.Thread(target=close)
    closer.start()
    held.release.set()
    closer.join()
    # close() waited for the stuck delete and for the pass queued behind it (step 2's).
    assert events == ["deleted step-1", "deleted step-2", "closed"]
    assert Layout(root).committed_steps() == [3]
    assert not list((root / ".pending").iterdir())
    assert _restored(root) == (3, 3.0)


def test_a_step_saved_again_while_a_pass_is_deleting_is_not_deleted(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass decided to delete steps 1 and 2; while it is stuck on step 1, step 2 is saved again. The new
    step 2 is not what the pass judged: it survives, with its new contents."""
    with safepoint.CheckpointManager(root, cluster=BACKGROUND) as mgr:  # no policy: both kept
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
    mgr = safepoint.CheckpointManager(root, cluster=BACKGROUND, keep=safepoint.Keep(last=1))
    assert isinstance(mgr.layout, Layout)
    real_fence, go, stuck = mgr.layout.fence, threading.Event(), threading.Event()

    def fence(action: str) -> None:
        if action == "deleting step 1":
            stuck.set()
            assert go.wait(120)
        real_fence(action)

    monkeypatch.setattr(mgr.layout, "fence", fence)
    try:
        mgr.save(3, _state(3))  # the pass: delete 1 and 2 (keep_last=1), stuck before step 1's rename
        assert stuck.wait(120)
        mgr.save(2, _state(20))  # step 2 again, new bytes
        go.set()
        mgr.wait()
        assert Layout(root).committed_steps() == [2, 3]
    finally:
        go.set()
        mgr.close()
    assert _restored(root, step=2) == (2, 20.0)


def _take_over(lease_path: Path) -> None:
    """What another job's takeover does: the old file renamed aside, a new record linked in its place."""
    os.rename(lease_path, lease_path.with_name(".lease.stale-x"))
    tmp = lease_path.with_name(".lease.x.tmp")
    tmp.write_text(json.dumps({"host": "nodeB", "pid": 7, "heartbeat": 0.0, "token": "theirs"}))
    os.link(tmp, lease_path)


def test_the_deleter_thread_deletes_nothing_after_the_lease_is_lost(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = safepoint.CheckpointManager(root, cluster=BACKGROUND, keep=safepoint.Keep(last=1))
    assert isinstance(mgr.layout, Layout)
    real_fence, go, stuck = mgr.layout.fence, threading.Event(), threading.Event()

    def fence(action: str) -> None:
        if action.startswith("deleting"):
            stuck.set()
            assert go.wait(120)
        real_fence(action)

    monkeypatch.setattr(mgr.layout, "fence", fence)
    try:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))  # queues the deletion of step 1, held before the fence
        assert stuck.wait(120)
        _take_over(root / ".lease")  # another job owns ROOT now
        go.set()
        mgr.wait()  # the pass ran: its delete was refused (logged), nothing raised into training
        assert (root / "step-1" / "safepoint.json").exists()
        # The deleter stopped for good: its thread ended, and no later save gets a pass.
        (deleter,) = [t for t in threading.enumerate() if t.name == "safepoint-retention"] or [None]
        if deleter is not None:
            deleter.join(60)
            assert not deleter.is_alive(), "the deleter thread still runs after the lease was lost"
        with pytest.raises(LeaseError, match="no longer owns"):
            mgr.save(3, _state(3))
        assert not any(t.name == "safepoint-retention" for t in threading.enumerate())
        assert (root / "step-1" / "safepoint.json").exists()
    finally:
        go.set()
        with contextlib.suppress(safepoint.CheckpointError):
            mgr.close()


def test_a_preemption_notice_stops_the_deleter_and_the_emergency_save_does_not_wait_on_it(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """keep_last=1. Step 1's delete is stuck when the notice comes, step 3's pass (deleting step 2) is
    queued behind it: the emergency save of step 4 commits while the delete is stuck, the queued pass and
    the emergency save's own are dropped, and close() waits for step 1's delete only (under the lease).
    The next owner's first save deletes what was left."""
    events: list[str] = []
    held = _HeldDelete(layout_module.remove_tree, events)
    monkeypatch.setattr(layout_module, "remove_tree", held)
    mgr = safepoint.CheckpointManager(
        root, preemption=safepoint.PreemptionOptions(signals=(signal.SIGTERM,)), keep=safepoint.Keep(last=1)
    )
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    assert held.started.wait(120)
    mgr.save(3, _state(3))  # its pass would delete step 2: queued behind the stuck delete
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(safepoint.Preempted) as info:
        mgr.maybe_save(4, _state(4))
    assert info.value.saved_step == 4  # committed with step 1's delete still stuck
    assert Layout(root).committed_steps() == [2, 3, 4]
    closer = threading.Thread(target=mgr.close)
    closer.start()
    held.release.set()
    closer.join()
    assert events == ["deleted step-1"]  # nothing after the notice
    assert Layout(root).committed_steps() == [2, 3, 4] and not list((root / ".pending").iterdir())
    monkeypatch.setattr(layout_module, "remove_tree", held.real)
    with safepoint.CheckpointManager(root, keep=safepoint.Keep(last=1)) as mgr:
        assert mgr.restore(_state(-1)) == 4
        mgr.save(5, _state(5))
    assert Layout(root).committed_steps() == [4, 5]  # 2 and 3 deleted; 4 is the newest verified


_CHILD = """
import sys, safepoint, torch, safepoint.store.posix_layout as L
real = L.remove_tree
def stuck(path):
    files = sorted(p for p in path.iterdir() if p.is_file())
    files[0].unlink()  # half deleted
    print("deleting", path.name, flush=True)
    open(sys.argv[2]).read()  # held until the parent kills this process
    return real(path)
L.remove_tree = stuck
def state(n):
    return safepoint.TrainState(rng=False, extra={"t": torch.full((64,), float(n))})
mgr = safepoint.CheckpointManager(sys.argv[1], keep=safepoint.Keep(last=1), cluster=safepoint.ClusterOptions(background_deletes=True))
mgr.save(1, state(1))
mgr.save(2, state(2))
mgr.save(3, state(3))
print("saved 3", flush=True)
open(sys.argv[2]).read()
"""


class _Child:
    """A Python child forked from the fork server (tests/helpers/example_runs.py ``spawn_job``: a real
    process with its own session, real signals and the interpreter's own exit, without a fresh
    interpreter's ~4.5 s of CPU): ``stdout`` is its output; it reads its go-ahead from the FIFO ``hold``
    (argv[2]; a forked child's stdin is /dev/null)."""

    def __init__(self, proc: forkserver.Child, stdout: IO[str], hold: Path) -> None:
        self.proc, self.stdout, self.hold = proc, stdout, hold

    def release(self, line: str) -> None:
        """Write ``line`` to the FIFO once the child opened it (ENXIO until then), failing if it ends first."""
        deadline = time.monotonic() + 60
        while True:
            try:
                fd = os.open(self.hold, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as e:
                if e.errno != errno.ENXIO or time.monotonic() > deadline:
                    raise
                with contextlib.suppress(TimeoutError):
                    self.proc.wait(0.05)  # the server reports the child's end: never wait on a dead one
                assert self.proc.returncode is None, f"the child ended with {self.proc.returncode}"
        with os.fdopen(fd, "w") as f:
            f.write(line)


@contextlib.contextmanager
def _child(code: str, root: Path) -> Iterator[_Child]:
    """``code`` in a Python child (argv[1] = ``root``, argv[2] = the FIFO it waits on) with a pipe from its
    stdout; killed on the way out if it is still running (a failed assert never leaves it behind)."""
    hold = root.parent / "hold.fifo"
    os.mkfifo(hold)
    script = root.parent / "child.py"
    script.write_text(code)
    out_r, out_w = os.pipe()
    try:
        proc = spawn_job([str(script), str(root), str(hold)], out_w, 2)
    except BaseException:
        os.close(out_r)
        raise
    finally:
        os.close(out_w)
    with open(out_r) as stdout:
        try:
            yield _Child(proc, stdout, hold)
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_kill_9_mid_background_delete_leaves_a_root_the_next_manager_cleans_and_restores(
    root: Path,
) -> None:
    with _child(_CHILD, root) as child:
        assert child.stdout is not None
        lines = {child.stdout.readline().strip() for _ in range(2)}
        assert "saved 3" in lines and any(line.startswith("deleting deleting-step-1-") for line in lines)
        os.kill(child.proc.pid, signal.SIGKILL)
        assert child.proc.wait(60) == -signal.SIGKILL
    # Half of step 1 is left, out of the listing; nothing half-deleted looks committed.
    assert Layout(root).committed_steps() == [2, 3]
    (leftover,) = (root / ".pending").iterdir()
    assert leftover.name.startswith("deleting-step-1-")
    with safepoint.CheckpointManager(root, cluster=BACKGROUND, keep=safepoint.Keep(last=1)) as mgr:
        assert not list((root / ".pending").iterdir())  # the new owner cleaned it up
        state = _state(-1)
        assert mgr.restore(state) == 3
        assert float(state.extra["t"][0]) == 3.0  # type: ignore[index]
        mgr.save(4, _state(4))
    assert Layout(root).committed_steps() == [3, 4]  # 2 deleted; 3 is the newest this manager verified


_EXIT_CHILD = """
import atexit, sys, safepoint, torch, safepoint.store.posix_layout as L
def say(line):  # one write per line: print() writes the text and the newline apart, and two threads
    sys.stdout.write(line + "\\n")  # (the deleter's, the exiting main one) interleaved as "exitingdeleting"
    sys.stdout.flush()
real = L.remove_tree
def held(path):
    say("deleting")
    open(sys.argv[2]).readline()  # held until the parent has seen the interpreter start exiting
    real(path)
    say("deleted")
L.remove_tree = held
def state(n):
    return safepoint.TrainState(rng=False, extra={"t": torch.full((64,), float(n))})
mgr = safepoint.CheckpointManager(sys.argv[1], keep=safepoint.Keep(last=1))
atexit.register(say, "exiting")  # registered after the manager's: runs before it
mgr.save(1, state(1))
mgr.save(2, state(2))
"""


def test_a_script_that_ends_without_close_lets_the_deleter_finish(root: Path) -> None:
    """No close(), no with: the interpreter's exit waits for the delete in flight (under the lease)."""
    with _child(_EXIT_CHILD, root) as child:
        lines = {child.stdout.readline().strip() for _ in range(2)}
        assert lines == {"deleting", "exiting"}, lines
        child.release("go\n")
        rest = child.stdout.read()
        assert child.proc.wait(60) == 0
    assert "deleted" in rest
    assert Layout(root).committed_steps() == [2] and not list((root / ".pending").iterdir())
