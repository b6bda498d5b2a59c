"""async_writer="process": the writes of async saves run in a writer process per rank.

Real processes and real signals: the writer process is SIGKILLed mid-write, its rank is SIGKILLed
mid-write, and a real kernel limit (RLIMIT_FSIZE, inherited by the writer process only) fails its write.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import psutil
import pytest
import torch

import safepoint
from safepoint.save import background, ipc, writer_choice, writer_process
from tests.conftest import SUBPROCESS_ENV
from tests.helpers import forkserver
from tests.helpers.example_runs import spawn_job
from tests.helpers.train import Setup, assert_bitwise_equal, big_state

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the process writer is Linux-only")


def _manager(
    root: Path, *, ready: bool = True, incremental: bool = True, **kw: object
) -> safepoint.CheckpointManager:
    """A manager with the process writer; ``ready``: once its process is ready (saves that come before
    are written by the writer thread, and these tests are about the process)."""
    # "wait": every save goes through the writer (the default, "auto", writes a save that finds the previous
    # one still writing synchronously, so the process's counts below would depend on timing).
    writer = safepoint.WriterOptions(async_writer="process", incremental=incremental, if_busy="wait")
    mgr = safepoint.CheckpointManager(root, async_save=True, writer=writer, **kw)  # type: ignore[arg-type]
    if ready:
        assert mgr._process is not None
        mgr._process.wait_ready()
    return mgr


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _wait_for_shard(root: Path, step: int, timeout_s: float = 60.0) -> Path:
    """The rank's data file of ``step`` once the writer has started filling it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for f in (root / ".pending").glob(f"step-{step}-*/__0_0.distcp"):
            if f.stat().st_size > 0:
                return f
        time.sleep(0.002)
    raise AssertionError(f"no data file of step {step} appeared")


def test_snapshot_is_consistent_and_resume_is_bitwise(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    ref = Setup()
    for _ in range(9):
        ref.step()
    s = Setup()
    mgr = _manager(root, save_every_steps=3)
    with contextlib.closing(mgr):
        for step in range(1, 7):
            s.step()
            expected = s.snapshot()
            mgr.maybe_save(step, s.state())
            if step == 6:
                # Training goes on at once: overwrite every value; the checkpoint keeps the staged ones.
                with torch.no_grad():
                    for p in s.model.parameters():
                        p.fill_(123.0)
        mgr.wait()
        assert mgr._process is not None and mgr._process.started == 1
        # Steps 3 and 6: the plan and the places went over once; step 6 sent its values only (the resume
        # below checks they are step 6's: Adam's step, the scheduler, the extra state).
        assert mgr._process.writes == 2 and mgr._process.descriptions == 1
        assert mgr._process.same_results == 1  # every item the same size: step 3's offsets held
        writer_pid = mgr._process.pid
        assert writer_pid is not None and writer_pid != os.getpid()
        _close_beside_a_holder_of_the_channel(mgr, caplog)
    assert writer_pid is not None and not _alive(writer_pid), "close() must end the writer process"
    s2 = Setup(seed=11)
    with safepoint.CheckpointManager(root) as again:
        assert again.restore(s2.state()) == 6
        assert_bitwise_equal(expected, s2.snapshot())
        for _ in range(3):
            s2.step()
    assert_bitwise_equal(ref.snapshot(), s2.snapshot())


class _Noted(torch.nn.Module):
    """A module with extra state: a byte item of DCP's whose size can change while the plan does not."""

    note = ""

    def get_extra_state(self) -> str:
        return self.note

    def set_extra_state(self, state: str) -> None:
        self.note = state


def test_a_new_staging_segment_when_the_state_changes_shape(root: Path) -> None:
    m = _Noted()
    m.a = torch.nn.Parameter(torch.full((1000,), 1.0))
    # Not incremental: every save writes every item, into DCP's own file (compared with a sync save's
    # below); tests/save/test_incremental_process.py has the incremental saves.
    with _manager(root, incremental=False) as mgr:
        mgr.save(1, safepoint.TrainState(model=m, rng=False))
        mgr.wait()
        first = mgr._stager.arena
        assert first is not None
        first_id = first.id
        m.b = torch.nn.Parameter(torch.full((5000,), 2.0))  # the model grew: new buffers, new segment
        with torch.no_grad():
            m.a.fill_(3.0)
        m.note = "xx"
        mgr.save(2, safepoint.TrainState(model=m, rng=False))
        mgr.wait()
        assert mgr._stager.allocations == 2
        assert mgr._stager.arena is not None and mgr._stager.arena.id != first_id
        process = mgr._process
        assert process is not None and process.descriptions == 2  # a changed state is described afresh
        with torch.no_grad():
            m.a.fill_(4.0)
        m.note = "x" * 1000
        mgr.save(3, safepoint.TrainState(model=m, rng=False))
        mgr.wait()
        assert process.descriptions == 2 and process.writes == 3  # unchanged: "same as last time"
        assert process.same_results == 0  # a longer byte item: its write results came back anew
        # A rank whose record disagrees with the process (here: a key the process never got) is answered
        # "stale" and describes the save in full: never a write from a description the process lacks.
        assert process._held is not None
        process._held.key += 1
        with torch.no_grad():
            m.b.fill_(5.0)
        m.note = "xxxx"
        mgr.save(4, safepoint.TrainState(model=m, rng=False))
        mgr.wait()
        assert process.stale == 1 and process.descriptions == 3
    # The process wrote the bytes a synchronous save writes (the byte item too: torch's CRC-32 off in both).
    with safepoint.CheckpointManager(root.parent / "sync") as sync:
        sync.save(4, safepoint.TrainState(model=m, rng=False))
    data = "step-4/__0_0.distcp"
    assert (root / data).read_bytes() == (root.parent / "sync" / data).read_bytes()
    fresh = _Noted()
    fresh.a = torch.nn.Parameter(torch.zeros(1000))
    fresh.b = torch.nn.Parameter(torch.zeros(5000))
    with safepoint.CheckpointManager(root) as again:
        assert again.restore(safepoint.TrainState(model=fresh, rng=False), step=2) == 2
        assert torch.all(fresh.a == 3.0) and torch.all(fresh.b == 2.0) and fresh.note == "xx"
        assert again.restore(safepoint.TrainState(model=fresh, rng=False), step=3) == 3
        assert torch.all(fresh.a == 4.0) and torch.all(fresh.b == 2.0) and fresh.note == "x" * 1000
        assert again.restore(safepoint.TrainState(model=fresh, rng=False)) == 4
        assert torch.all(fresh.a == 4.0) and torch.all(fresh.b == 5.0) and fresh.note == "xxxx"


def test_writer_process_killed_mid_write_fails_that_save_only(root: Path) -> None:
    m, st = big_state(256, fill=1.0)
    with _manager(root) as mgr:
        mgr.save(1, st)
        mgr.wait()
        assert mgr._process is not None
        pid = mgr._process.pid
        assert pid is not None
        with torch.no_grad():
            m.w.fill_(2.0)  # changed: written (an unchanged state would go to a stable group, not __0_0)
        mgr.save(2, st)
        _wait_for_shard(root, 2)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(safepoint.SaveError) as err:
            mgr.wait()
        msg = str(err.value)
        assert "save of step 2 failed and was not committed" in msg
        assert f"writer process (pid {pid}) died while writing: killed by SIGKILL" in msg
        assert [c.step for c in mgr.list()] == [1]
        # The next save starts a new writer process and commits (once it is ready, so that the process
        # writes it, not the thread meanwhile).
        with torch.no_grad():
            m.w.fill_(3.0)
        mgr._process.wait_ready()
        mgr.save(3, st)
        mgr.wait()
        assert mgr._process.started == 2 and mgr._process.pid != pid
        # The new process was sent the full description at once (the rank forgot what the dead one held).
        assert mgr._process.descriptions == 2 and mgr._process.stale == 0
        # Restarted from the writer thread (itself at +WRITER_NICE), yet at the rank's priority + WRITER_NICE.
        expected = min(19, os.getpriority(os.PRIO_PROCESS, 0) + background.WRITER_NICE)
        assert os.getpriority(os.PRIO_PROCESS, mgr._process.pid) == expected
        assert [c.step for c in mgr.list()] == [1, 3]
    assert not list((root / ".pending").iterdir())
    fresh, fst = big_state(256)
    with safepoint.CheckpointManager(root) as again:
        assert again.restore(fst) == 3
    assert torch.all(fresh.w == 3.0)


@contextmanager
def _file_size_limit(nbytes: int) -> Iterator[None]:
    """Lower RLIMIT_FSIZE for processes started meanwhile (the writer process keeps it), not for us after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_write_error_in_the_writer_process_names_the_os_error(root: Path) -> None:
    """Also: a SIGTERM and a SIGINT to the process group while the writer process starts are ignored (it
    ignores both before its imports; one writer process for both checks, ~4 s of CPU each)."""
    _, small = big_state(1)
    _m, large = big_state(8)
    with _file_size_limit(4 * 1024 * 1024):
        mgr = _manager(root, ready=False)  # the writer process starts here and inherits the 4 MiB limit
    with mgr:
        assert mgr._process is not None and mgr._process.pid is not None
        time.sleep(0.3)  # the process is importing torch now
        os.kill(mgr._process.pid, signal.SIGTERM)
        os.kill(mgr._process.pid, signal.SIGINT)
        mgr._process.wait_ready()
        mgr.save(1, small)
        mgr.wait()
        mgr.save(2, large)  # an 8 MiB file: the kernel refuses it with EFBIG in the writer process
        with pytest.raises(safepoint.SaveError) as err:
            mgr.wait()
        assert "save of step 2 failed and was not committed" in str(err.value)
        assert "File too large" in str(err.value)
        assert [c.step for c in mgr.list()] == [1]
        # The same process goes on serving saves that fit.
        mgr.save(3, small)
        mgr.wait()
        assert mgr._process is not None and mgr._process.started == 1
        assert [c.step for c in mgr.list()] == [1, 3]


def test_writer_process_exits_when_its_rank_is_killed(root: Path) -> None:
    script = (
        "import sys, torch, safepoint\n"
        "m = torch.nn.Module(); m.w = torch.nn.Parameter(torch.ones(512 * 1024 * 1024 // 4))\n"
        f"mgr = safepoint.CheckpointManager({str(root)!r}, async_save=True, writer=safepoint.WriterOptions(async_writer='process'))\n"
        "mgr.save(1, safepoint.TrainState(model=m, rng=False))\n"
        "print(mgr._process.pid, flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    rank, lines = _rank(script)
    try:
        writer_pid = int(lines.readline())
        _wait_for_shard(root, 1)
        os.kill(rank.pid, signal.SIGKILL)  # no close(), no atexit
        rank.wait()
        deadline = time.monotonic() + 10
        while _alive(writer_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(writer_pid), "the writer process outlived its rank"
    finally:
        _end(rank, lines)
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.list() == []  # the half-written save never committed


def _rank(script: str) -> tuple[forkserver.Child, IO[str]]:
    """A rank running ``python -c SCRIPT``, forked from the suite's fork server (its own session; the
    subject is the writer process it starts, a fresh interpreter as always), and a reader of its stdout."""
    r, w = os.pipe()
    try:
        rank = spawn_job(["-c", script], w, 2)
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return rank, os.fdopen(r)


def _end(rank: forkserver.Child, lines: IO[str]) -> None:
    if rank.returncode is None:  # once waited for, its pid may be another process's
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank.pid, signal.SIGKILL)
        rank.wait()
    lines.close()


def _maps_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")
def test_a_writer_process_still_starting_dies_with_its_rank(root: Path) -> None:
    """Frozen while it imports torch (SIGSTOP: as stuck as a thrashing node makes it), the process still
    dies the moment its rank does: the kernel's death signal, set before the import, needs no poll."""
    script = (
        "import os, sys, safepoint\n"
        f"mgr = safepoint.CheckpointManager({str(root)!r}, async_save=True, "
        "writer=safepoint.WriterOptions(async_writer='process'))\n"
        "print(mgr._process.pid, flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    rank, lines = _rank(script)
    writer_pid = 0
    try:
        writer_pid = int(lines.readline())
        deadline = time.monotonic() + 120
        while not _maps_torch(writer_pid):  # past the launch line: importing torch now
            assert _alive(writer_pid) and time.monotonic() < deadline, "the writer never began its import"
            time.sleep(0.02)
        os.kill(writer_pid, signal.SIGSTOP)
        os.kill(rank.pid, signal.SIGKILL)
        rank.wait()
        deadline = time.monotonic() + 30
        while _alive(writer_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(writer_pid), "a writer process frozen in its start outlived its rank"
    finally:
        _end(rank, lines)
        if writer_pid and _alive(writer_pid):
            os.kill(writer_pid, signal.SIGKILL)


def test_arguments_are_checked(root: Path) -> None:
    with pytest.raises(ValueError, match="async_writer must be 'auto', 'thread' or 'process'"):
        safepoint.WriterOptions(async_writer="fork")
    with pytest.raises(ValueError, match="pass async_save=True"):
        safepoint.CheckpointManager(root, writer=safepoint.WriterOptions(async_writer="process"))
    with pytest.raises(ValueError, match="with a URL root, pass local_root="):
        safepoint.CheckpointManager(
            "s3://bucket/run", async_save=True, writer=safepoint.WriterOptions(async_writer="process")
        )


@pytest.mark.slow
def test_managers_leave_no_process_or_descriptor_behind(root: Path) -> None:
    _, st = big_state(1)
    me = psutil.Process()

    def census() -> tuple[int, int]:
        gc.collect()  # descriptors of earlier tests' garbage go now, not in the middle of the count
        return len(me.children(recursive=True)), me.num_fds()

    with _manager(root) as mgr:  # a first one: lazily created descriptors (logging, torch) exist after it
        mgr.save(0, st)
    before = census()
    for step in range(1, 3):
        with _manager(root) as mgr:
            mgr.save(step, st)
    with _manager(root, ready=False):
        pass  # closed while its process may still be starting: stopped, not waited for
    after = census()
    assert after[0] <= before[0] and after[1] <= before[1], (before, after)


@pytest.mark.slow
def test_auto_falls_back_to_the_thread_when_no_process_can_start(
    root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A writer process that cannot start (here: its module is missing, so python exits 1 at once).
    monkeypatch.setattr(writer_process, "CHILD_MODULE", "safepoint.no_such_module")
    monkeypatch.setattr(writer_choice, "AUTO_PROCESS_MIN_ITEMS", 1)  # "auto" starts it at the first save
    _, st = big_state(1)
    with caplog.at_level(logging.WARNING, logger="safepoint"):
        with safepoint.CheckpointManager(root / "auto", async_save=True) as mgr:
            mgr.save(1, st)
            assert mgr._process is not None and mgr._process._proc is not None
            mgr._process._proc.wait(timeout=120)  # (while it starts, the thread writes without asking)
            mgr.save(2, st)
            mgr.save(3, st)
            mgr.wait()
            assert [c.step for c in mgr.list()] == [1, 2, 3]
            assert mgr._process is not None and mgr._process.started == 1  # not retried per save
    assert "died while starting: exit code 1" in caplog.text
    assert "written on a background thread instead" in caplog.text
    # Asked for explicitly, the process is required: the save fails (not committed) and says why.
    with _manager(root / "explicit", ready=False) as mgr:
        assert mgr._process is not None and mgr._process._proc is not None
        mgr._process._proc.wait(timeout=120)
        mgr.save(1, st)
        with pytest.raises(safepoint.SaveError, match="died while starting: exit code 1"):
            mgr.wait()
        assert mgr.list() == []


def _staging_maps(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("safepoint-staging" in line for line in f)


@pytest.mark.slow  # time bar of the default suite: another staging segment per shape change is covered by test_a_new_staging_segment_when_the_state_changes_shape
def test_the_writer_process_unmaps_the_old_segment_before_a_new_one_is_allocated(root: Path) -> None:
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.full((1 << 20,), 1.0))
    drops: list[int] = []
    with _manager(root) as mgr:
        assert mgr._process is not None
        mgr.save(1, safepoint.TrainState(model=m, rng=False))
        mgr.wait()
        pid = mgr._process.pid
        assert pid is not None and _staging_maps(pid) >= 1
        real_drop = mgr._process.drop_arena

        def drop() -> None:
            real_drop()
            drops.append(_staging_maps(pid))  # what the writer process maps when the new set is allocated

        mgr._stager._before_alloc = drop
        m.b = torch.nn.Parameter(torch.full((3 << 20,), 2.0))  # the state grew: a new staging set
        mgr.save(2, safepoint.TrainState(model=m, rng=False))
        mgr.wait()
    assert drops == [0], "the old segment was still mapped by the writer process"
    fresh = torch.nn.Module()
    fresh.a = torch.nn.Parameter(torch.zeros(1 << 20))
    fresh.b = torch.nn.Parameter(torch.zeros(3 << 20))
    with safepoint.CheckpointManager(root) as again:
        assert again.restore(safepoint.TrainState(model=fresh, rng=False)) == 2
    assert torch.all(fresh.a == 1.0) and torch.all(fresh.b == 2.0)


def test_a_broken_exchange_ends_the_process_and_never_desyncs_the_channel(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error after the request went out (here the reply fails to arrive once): the unread reply must not
    be taken for the next save's. The process is ended; the next save starts another and is exact."""
    m, st = big_state(1, fill=1.0)
    with _manager(root) as mgr:
        mgr.save(1, st)
        mgr.wait()
        real_recv = ipc.recv
        calls = {"n": 0}

        def flaky_recv(sock: object) -> object:
            calls["n"] += 1
            if calls["n"] == 1:
                raise MemoryError("injected: the reply could not be read")
            return real_recv(sock)  # type: ignore[arg-type]

        monkeypatch.setattr(writer_process.ipc, "recv", flaky_recv)
        with torch.no_grad():
            m.w.fill_(2.0)
        mgr.save(2, st)
        with pytest.raises(safepoint.SaveError, match="killed by safepoint: the exchange with it failed"):
            mgr.wait()
        with torch.no_grad():
            m.w.fill_(3.0)
        mgr.save(3, st)
        mgr.wait()
        assert mgr._process is not None and mgr._process.started == 2
        assert [c.step for c in mgr.list()] == [1, 3]
    fresh, fst = big_state(1)
    with safepoint.CheckpointManager(root) as again:
        assert again.restore(fst) == 3
    assert torch.all(fresh.w == 3.0)


def _close_beside_a_holder_of_the_channel(
    mgr: safepoint.CheckpointManager, caplog: pytest.LogCaptureFixture
) -> None:
    """close() does not wait on a process that inherited the channel: a DataLoader worker forked after the
    manager holds a copy of the rank's end of it. (Checked at the close of
    test_snapshot_is_consistent_and_resume_is_bitwise: a writer process of its own costs ~4 s of CPU.)"""
    assert mgr._process is not None and mgr._process._sock is not None
    holder = subprocess.Popen(["sleep", "60"], pass_fds=[mgr._process._sock.fileno()])
    try:
        with caplog.at_level(logging.WARNING, logger="safepoint"):
            mgr.close()
        # Waiting on the holder's copy would have run into close()'s timeout, which kills the process
        # and says so: the log tells it, not a wall-clock bound (which a loaded machine breaks).
        assert "did not exit" not in caplog.text and holder.poll() is None
    finally:
        holder.kill()
        holder.wait()


_HOLD = """import os, time
# Test only: a Python started while SAFEPOINT_TEST_HOLD names an existing file waits here, before it
# imports anything, until the file is gone (how the test holds a real writer process from getting ready).
while os.environ.get("SAFEPOINT_TEST_HOLD") and os.path.exists(os.environ["SAFEPOINT_TEST_HOLD"]):
    time.sleep(0.01)
"""


# "auto" under -m slow for the default suite's time: while the process starts, WriterProcess.write never
# reads ``fallback`` (the only difference between the two: it matters when no process can start, covered
# by test_auto_falls_back_to_the_thread_when_no_process_can_start); "process" runs the same path. "auto"
# starts its process at the first save whose state is large enough (here, with the threshold lowered, the
# first save: tests/save/test_auto_writer.py), and that save and the next are the thread's all the same.
@pytest.mark.parametrize("writer", [pytest.param("auto", marks=pytest.mark.slow), "process"])
def test_saves_never_wait_for_the_writer_process_to_start(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    """A writer process held from getting ready (a real one, stuck in its interpreter's startup): the saves
    meanwhile are written and committed by the writer thread, and maybe_save never waits for the process;
    once it is ready, the process takes over."""
    held = tmp_path / "site"
    held.mkdir()
    (held / "sitecustomize.py").write_text(_HOLD)
    hold = tmp_path / "hold"
    hold.touch()
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (str(held), os.environ.get("PYTHONPATH")) if p)
    )
    monkeypatch.setenv("SAFEPOINT_TEST_HOLD", str(hold))
    if writer == "auto":
        monkeypatch.setattr(writer_choice, "AUTO_PROCESS_MIN_ITEMS", 1)  # big_state's one tensor pays
    m, st = big_state(1)
    done: list[int] = []
    options = safepoint.WriterOptions(async_writer=writer, if_busy="wait")  # every save by the writer
    mgr = safepoint.CheckpointManager(root, save_every_steps=1, async_save=True, writer=options)
    loop = None
    try:
        assert (mgr._process is None) == (writer == "auto")  # "auto": started by the first save

        def train() -> None:
            for step in range(1, 4):
                with torch.no_grad():
                    m.w.fill_(float(step))
                assert mgr.maybe_save(step, st)
                done.append(step)
            mgr.wait()
            done.append(0)

        loop = threading.Thread(target=train, daemon=True)
        loop.start()
        loop.join(timeout=120)  # a guard against a hang, not a speed check: without the fix this never ends
        assert done == [1, 2, 3, 0], f"maybe_save waited for the writer process to start (done: {done})"
        process = mgr._process
        assert (
            process is not None and process.pid is not None and _alive(process.pid) and process.started == 1
        )
        assert process.writes == 0 and process.thread_writes == 3
        assert [c.step for c in mgr.list()] == [1, 2, 3]
        hold.unlink()  # released: the process imports torch, reports ready, and writes the next save
        process.wait_ready()
        with torch.no_grad():
            m.w.fill_(4.0)
        mgr.save(4, st)
        mgr.wait()
        assert process.writes == 1 and process.started == 1
    finally:
        hold.unlink(missing_ok=True)
        if loop is not None:
            loop.join()
        mgr.close()
    for step in (3, 4):
        fresh, fst = big_state(1)
        with safepoint.CheckpointManager(root) as again:
            assert again.restore(fst, step=step) == step
        assert torch.all(fresh.w == float(step))


@pytest.mark.slow  # time bar of the default suite: a rare environment; the descriptor passing itself runs in every async test
def test_async_saves_work_with_descriptors_numbered_above_1024(root: Path) -> None:
    """select() refuses descriptors >= 1024 (FD_SETSIZE): with many files already open when the manager
    starts, its channel to the writer process gets such a number, and every async save used to fail."""
    script = (
        "import os, resource, sys, torch, safepoint\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))\n"
        "held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]\n"
        "m = torch.nn.Linear(4, 4)\n"
        f"mgr = safepoint.CheckpointManager({str(root)!r}, async_save=True, "
        "writer=safepoint.WriterOptions(async_writer='process'))\n"
        "mgr._process.wait_ready()\n"
        "for step in (1, 2):\n"
        "    mgr.save(step, safepoint.TrainState(model=m, rng=False))\n"
        "    mgr.wait()\n"
        "print(mgr._process.writes, [c.step for c in mgr.list()], flush=True)\n"
        "mgr.close()\n"
    )
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2048:
        pytest.skip("the hard descriptor limit is below 2048 here")
    out = subprocess.run(
        [sys.executable, "-c", script], env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[0] == "2 [1, 2]"


def test_a_launch_that_popen_refuses_leaks_no_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    """Popen raising something other than OSError (ValueError: a NUL byte in an argument) still closes both
    ends of the channel, and is a start failure like any other: "auto" falls back to the thread."""
    monkeypatch.setattr(sys, "executable", "/no/such\0python")
    me = psutil.Process()
    before = me.num_fds()
    process = writer_process.WriterProcess()
    with pytest.raises(writer_process.WriterProcessError, match="could not start") as err:
        process._start()
    assert isinstance(err.value.__cause__, ValueError)
    # err keeps the failed call's frame (and whatever it references) alive: nothing may stay open anyway.
    assert me.num_fds() == before
    fallback = writer_process.WriterProcess(fallback=True)
    fallback.start()
    assert fallback.unavailable is not None and "could not start" in fallback.unavailable
    assert me.num_fds() == before
