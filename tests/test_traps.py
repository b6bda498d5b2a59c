"""Two traps a newcomer fell into, now caught: ``save(N)`` for the step ``maybe_save(N)`` just committed
(it used to write step N again and drop the metrics retention ranks by), and a second manager on a root
this same process holds (it used to raise a LeaseError naming the process's own pid as the other job)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

import safepoint
from safepoint.errors import SaveError
from safepoint.store.posix_layout import Layout
from tests.helpers.train import Setup

ALREADY = "step 5 is already committed"


def _manifest(root: Path, step: int) -> bytes:
    return (root / f"step-{step}" / "safepoint.json").read_bytes()


# ---- save(N) after maybe_save(N) --------------------------------------------------------------------


def test_save_of_the_step_maybe_save_committed_says_so_and_keeps_its_metrics(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = Setup()
    with safepoint.CheckpointManager(root, save_every_steps=5) as mgr:
        s.step()
        assert mgr.maybe_save(5, s.state(), metrics={"loss": 0.5})
        before = _manifest(root, 5)
        with caplog.at_level(logging.WARNING, logger="safepoint"):
            info = mgr.save(5, s.state())  # the end of the loop, as many scripts write it
        assert info is not None and info.step == 5 and info.metrics == {"loss": 0.5}
        assert _manifest(root, 5) == before  # not written again
        assert ALREADY in caplog.text and "overwrite=True" in caplog.text
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="safepoint"):
            mgr.save(5, s.state(), metrics={"loss": 0.1})
        assert "the metrics given here are not recorded" in caplog.text
        assert [c.metrics for c in mgr.list()] == [{"loss": 0.5}]
        # Asked for explicitly, it is replaced, with the new metrics.
        replaced = mgr.save(5, s.state(), metrics={"loss": 0.1}, overwrite=True)
        assert replaced is not None and replaced.metrics == {"loss": 0.1}
        assert _manifest(root, 5) != before
        # Another step is saved as ever.
        assert mgr.save(6, s.state()) is not None
    assert Layout(root).committed_steps() == [5, 6]


def test_async_save_of_the_step_just_staged_is_not_written_again(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = Setup()
    writer = safepoint.WriterOptions(async_writer="thread")
    with safepoint.CheckpointManager(root, save_every_steps=5, async_save=True, writer=writer) as mgr:
        assert mgr.maybe_save(5, s.state(), metrics={"loss": 0.5})
        with caplog.at_level(logging.WARNING, logger="safepoint"):
            assert mgr.save(5, s.state()) is None
        mgr.wait()
        assert ALREADY in caplog.text
        assert [(c.step, c.metrics) for c in mgr.list()] == [(5, {"loss": 0.5})]
        assert len(mgr.saves) == 1  # one save was made, not two


def test_save_of_the_step_just_restored_is_not_written_again(root: Path) -> None:
    s = Setup()
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(5, s.state(), metrics={"loss": 0.5})
    before = _manifest(root, 5)
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(Setup(seed=1).state()) == 5
        info = mgr.save(5, s.state())
        assert info is not None and info.metrics == {"loss": 0.5}
    assert _manifest(root, 5) == before


def test_a_step_whose_background_save_failed_is_saved_again(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failure is raised by the next save of that step, and the one after writes it: a failed save is
    not a committed one."""
    s = Setup()
    writer = safepoint.WriterOptions(async_writer="thread")
    with safepoint.CheckpointManager(root, async_save=True, writer=writer) as mgr:
        assert mgr._bg_saver is not None
        real_write = mgr._bg_saver.write

        def fail_once(*args: object, **kw: object) -> object:
            monkeypatch.setattr(mgr._bg_saver, "write", real_write)
            raise SaveError("the disk is full (injected)")

        monkeypatch.setattr(mgr._bg_saver, "write", fail_once)
        mgr.save(5, s.state())
        mgr._writer.wait()  # the failure is recorded, not raised yet
        with pytest.raises(SaveError, match="injected"):
            mgr.save(5, s.state())
        mgr.save(5, s.state(), metrics={"loss": 0.5})
        mgr.wait()
        assert [(c.step, c.metrics) for c in mgr.list()] == [(5, {"loss": 0.5})]


# ---- a second manager on a root this process holds ---------------------------------------------------

HELD = "already held by another open CheckpointManager in this process"


def test_a_second_manager_on_a_root_this_process_holds_says_exactly_that(root: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    with safepoint.CheckpointManager(root) as first:
        os.symlink(root, link)
        for spelling in (root, str(root) + "/", f"file://{root}", link, root / ".." / root.name):
            with pytest.raises(safepoint.LeaseError, match=HELD) as e:
                safepoint.CheckpointManager(spelling)
            assert "\n" not in str(e.value) and f"pid {os.getpid()}" in str(e.value)
        # As the local tier of a tiered manager too.
        with pytest.raises(safepoint.LeaseError, match=HELD):
            safepoint.CheckpointManager(tmp_path / "durable", local_root=root)
        assert first.save(1, Setup().state()) is not None  # the first manager is untouched
    # Given back on close: a new manager opens, and so does one whose start failed (test_manager_start).
    with safepoint.CheckpointManager(root) as again:
        assert again.latest_step() == 1


def test_a_refused_second_manager_touches_nothing(root: Path, tmp_path: Path) -> None:
    with safepoint.CheckpointManager(root):
        lease = (root / ".lease").read_bytes()
        with pytest.raises(safepoint.LeaseError, match=HELD):
            safepoint.CheckpointManager(tmp_path / "other", local_root=root)
        assert (root / ".lease").read_bytes() == lease
        assert not (tmp_path / "other").exists()  # its other root was not claimed either
        with safepoint.CheckpointManager(tmp_path / "other"):
            pass
