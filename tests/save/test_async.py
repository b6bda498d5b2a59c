"""Async saves: block only for staging, one consistent snapshot, one save in flight, bounded memory, and
every background failure reaches the user while nothing half-written is ever committed."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import safepoint
from tests.conftest import REPO, SUBPROCESS_ENV
from tests.helpers.example_runs import run_job
from tests.helpers.train import Setup, assert_bitwise_equal, big_state


def test_snapshot_is_consistent_after_return(root: Path) -> None:
    s = Setup()
    with safepoint.CheckpointManager(root, async_save=True) as mgr:
        s.step()
        expected = s.snapshot()
        assert mgr.save(1, s.state()) is None
        # Training goes on at once: overwrite every parameter and optimizer value.
        with torch.no_grad():
            for p in s.model.parameters():
                p.fill_(123.0)
            for st in s.opt.state.values():
                for v in st.values():
                    v.fill_(7.0)
        mgr.wait()
        s2 = Setup(seed=4)
        assert mgr.restore(s2.state()) == 1
    assert_bitwise_equal(expected, s2.snapshot())


def test_async_resume_is_bitwise_identical(root: Path) -> None:
    ref = Setup()
    for _ in range(9):
        ref.step()
    s = Setup()
    with safepoint.CheckpointManager(root, async_save=True, save_every_steps=3) as mgr:
        for step in range(1, 7):
            s.step()
            mgr.maybe_save(step, s.state())
    s2 = Setup(seed=11)
    with safepoint.CheckpointManager(root, async_save=True) as mgr:
        assert mgr.restore(s2.state()) == 6
        for _ in range(3):
            s2.step()
    assert_bitwise_equal(ref.snapshot(), s2.snapshot())


@pytest.mark.parametrize("writer", [pytest.param("thread", marks=pytest.mark.slow), "process"])
def test_memory_is_bounded_and_flat_over_100_saves(tmp_path: Path, writer: str) -> None:
    shm = Path("/dev/shm")
    root = (shm if shm.is_dir() else tmp_path) / f"safepoint-mem-{os.getpid()}"
    try:
        out = subprocess.run(
            [
                sys.executable,
                str(REPO / "tests" / "helpers" / "procs" / "async_memory.py"),
                str(root),
                "100",
                "16",
                writer,
            ],
            capture_output=True,
            text=True,
            env=SUBPROCESS_ENV,
            check=True,
        )
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["allocations"] == 1, "staging buffers were reallocated"
    extra_peak = r["peak"] - r["base_rss"]
    # One staged copy at most (≤ 1.1x the state), never two.
    assert extra_peak <= 1.1 * r["state_bytes"], (extra_peak, r)
    growth = max(r["rss_after"]) - min(r["rss_after"])
    assert growth <= 0.1 * r["state_bytes"], f"RSS grew by {growth} bytes over 100 saves"
    if writer == "process":
        # The writer process reads the staged state where it lies (shared memory): its private memory
        # does not grow by a copy of the state, on any of the 100 saves. One process did all of them.
        child = r["child"]
        assert child["started"] == 1, child
        assert child["anon_peak"] - child["anon_base"] <= 0.1 * r["state_bytes"], child


def test_if_busy_skip_never_stages_twice(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    _, st = big_state(256)
    with safepoint.CheckpointManager(
        root, async_save=True, writer=safepoint.WriterOptions(if_busy="skip")
    ) as mgr:
        mgr.save(1, st)
        with caplog.at_level(logging.WARNING, logger="safepoint"):
            mgr.save(2, st)  # the 256 MiB write + fsync of step 1 is still running
        assert "skipping save of step 2" in caplog.text
        mgr.wait()
        assert [c.step for c in mgr.list()] == [1]
        assert mgr._stager.allocations == 1


def test_maybe_save_returns_false_when_if_busy_skips(root: Path) -> None:
    # A loop that tracks its newest checkpoint from maybe_save's answer (examples/ddp.py) must not be told a
    # skipped save happened: it would then skip its final save.
    _, st = big_state(256)
    with safepoint.CheckpointManager(
        root, async_save=True, writer=safepoint.WriterOptions(if_busy="skip"), save_every_steps=1
    ) as mgr:
        assert mgr.maybe_save(1, st) is True
        assert mgr.maybe_save(2, st) is False  # step 1's 256 MiB write is still running
        mgr.wait()
        assert [c.step for c in mgr.list()] == [1]


def test_if_busy_wait_logs_and_saves_both(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    _, st = big_state(128)
    with (
        safepoint.CheckpointManager(
            root, async_save=True, writer=safepoint.WriterOptions(if_busy="wait")
        ) as mgr,
        caplog.at_level(logging.INFO, logger="safepoint"),
    ):
        mgr.save(1, st)
        mgr.save(2, st)
        mgr.wait()
        assert [c.step for c in mgr.list()] == [1, 2]
    assert "waited" in caplog.text and "before saving step 2" in caplog.text


def test_background_failure_is_logged_raised_later_and_not_committed(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = Setup()
    with safepoint.CheckpointManager(root, async_save=True) as mgr:
        mgr.save(1, s.state())
        mgr.wait()
        # A real OS error in the writer thread: the pending area is a file, so DCP's mkdir fails.
        (root / ".pending").rmdir()
        (root / ".pending").write_text("in the way")
        with caplog.at_level(logging.ERROR, logger="safepoint"):
            mgr.save(2, s.state())  # returns: the failure happens in the background
            mgr._writer.wait()  # let it fail; the log line appears at once, before any further call
        assert "background save of step 2 failed" in caplog.text
        with pytest.raises(safepoint.SaveError, match="save of step 2 failed and was not committed"):
            mgr.save(3, s.state())
        # Training can continue: once the disk is fixed, saves work again.
        (root / ".pending").unlink()
        (root / ".pending").mkdir()
        mgr.save(3, s.state())
        mgr.wait()
        assert [c.step for c in mgr.list()] == [1, 3]


@pytest.mark.parametrize("call", ["wait", "close", "maybe_save"])
def test_background_failure_surfaces_from_each_call(root: Path, call: str) -> None:
    s = Setup()
    # "wait": maybe_save(2) waits for save 1 and raises its failure (the default, "auto", would save step 2
    # synchronously if save 1 were still failing, and raise that save's own failure).
    writer = safepoint.WriterOptions(if_busy="wait")
    mgr = safepoint.CheckpointManager(root, async_save=True, save_every_steps=1, writer=writer)
    (root / ".pending").rmdir()
    (root / ".pending").write_text("in the way")
    mgr.save(1, s.state())
    with pytest.raises(safepoint.SaveError, match="step 1"):
        if call == "wait":
            mgr.wait()
        elif call == "close":
            mgr.close()
        else:
            mgr.maybe_save(2, s.state())
    (root / ".pending").unlink()
    mgr.close()
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.list() == []


def test_close_waits_for_the_save_in_flight(root: Path) -> None:
    _, st = big_state(64)
    mgr = safepoint.CheckpointManager(root, async_save=True)
    mgr.save(5, st)
    mgr.close()
    with safepoint.CheckpointManager(root) as again:
        assert [c.step for c in again.list()] == [5]


def test_exit_without_close_is_safe(root: Path) -> None:
    script = (
        "import torch, safepoint\n"
        "m = torch.nn.Module(); m.w = torch.nn.Parameter(torch.ones(64 * 1024 * 1024 // 4))\n"
        f"mgr = safepoint.CheckpointManager({str(root)!r}, async_save=True)\n"
        "mgr.save(1, safepoint.TrainState(model=m, rng=False))\n"
        "mgr.save(2, safepoint.TrainState(model=m, rng=False))\n"
    )
    # Exits cleanly (no abort from a writer thread killed mid-file at shutdown). Forked from the suite's fork
    # server: the interpreter's own exit, which is the subject, without a fresh start (~5 s of CPU).
    proc = run_job(["-c", script], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(64 * 1024 * 1024 // 4))
    with safepoint.CheckpointManager(root) as mgr:
        steps = [c.step for c in mgr.list()]
        assert steps in ([1], [1, 2])  # the in-flight save committed fully, or not at all
        assert mgr.restore(safepoint.TrainState(model=m, rng=False)) == steps[-1]
        assert torch.all(m.w == 1)
    assert not list((root / ".pending").iterdir())


def test_if_busy_is_validated(root: Path) -> None:
    with pytest.raises(ValueError, match="if_busy must be"):
        safepoint.WriterOptions(if_busy="queue")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux-only")
@pytest.mark.parametrize("nice", [None, 0, 3])
def test_writer_thread_runs_at_lower_priority(monkeypatch: pytest.MonkeyPatch, nice: int | None) -> None:
    import threading

    from safepoint.save import background
    from safepoint.store.posix_layout import CheckpointInfo

    if nice is not None:  # set at run time, after import: read when the writer starts
        monkeypatch.setattr(background, "WRITER_NICE", nice)
    increment = background.WRITER_NICE
    assert nice is not None or increment == 10
    seen: list[int] = []

    def work() -> CheckpointInfo:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return CheckpointInfo(step=1, path="", time=0.0, bytes=0, metrics={})

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    writer = background.BackgroundWriter()
    writer.submit(1, work)
    writer.wait()
    writer.raise_failure()
    assert seen == [min(19, mine + increment)]
    # Only the writer thread: the training thread keeps its priority.
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


def test_each_async_save_records_the_bytes_it_staged(root: Path) -> None:
    # The count is taken once per buffer set (when the buffers are allocated), not walked again per save;
    # it must still be each save's bytes, and follow a change of shape.
    _, small = big_state(1)
    _, bigger = big_state(2)
    with safepoint.CheckpointManager(
        root, async_save=True, writer=safepoint.WriterOptions(async_writer="thread")
    ) as mgr:
        for step, state in ((1, small), (2, small), (3, bigger)):
            mgr.save(step, state)
            mgr.wait()
        assert [r.bytes for r in mgr.saves] == [1 << 20, 1 << 20, 2 << 20]
