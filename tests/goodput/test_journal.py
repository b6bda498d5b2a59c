"""The run journal and the progress file are read as hostile input (regular files only, bounded, every line
validated) and written append-only, bounded, by the root's owner only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import safepoint
from safepoint import events as ev
from safepoint.cli.main import main as cli
from safepoint.errors import CheckpointError
from safepoint.policy.goodput import build_report
from safepoint.policy.journal import (
    CARRY,
    JOURNAL_NAME,
    PROGRESS_NAME,
    Journal,
    parse_journal,
    read_journal,
    read_progress,
)

GOOD = {"event_type": "save", "step": 5, "wall_time": 100.0, "checkpoint_manager_blocking_duration_secs": 0.5}


@pytest.mark.parametrize(
    "line",
    [
        b"not json",
        b"[1, 2]",
        b'"a string"',
        b'{"event_type": "save", "step": 5}',  # no time
        b'{"event_type": "nonsense", "step": 5, "wall_time": 1.0}',
        b'{"event_type": "save", "step": true, "wall_time": 1.0}',  # a bool is no step
        b'{"event_type": "save", "step": -3, "wall_time": 1.0}',
        b'{"event_type": "save", "step": 5.5, "wall_time": 1.0}',
        b'{"event_type": "save", "step": 5, "wall_time": NaN}',  # Python's json reads NaN
        b'{"event_type": "save", "step": 5, "wall_time": Infinity}',
        b'{"event_type": "save", "step": 5, "wall_time": 1e400}',
        b'{"event_type": "save", "step": 5, "wall_time": 1.0, "checkpoint_manager_blocking_duration_secs": "1"}',
        b'{"event_type": "save", "step": 5, "wall_time": 1.0, "checkpoint_manager_blocking_duration_secs": -1}',
        b'{"event_type": "save", "step": 5, "wall_time": 1.0, "bytes_written": 100000000000000000000000}',
        b'{"event_type": "save", "step": 5, "wall_time": 1.0, "tier": 3}',
        b'{"event_type": "save", "step": 5, "wall_time": 1.0, "is_async": "yes"}',
        b'{"event_type": "carry", "wall_time": 1.0, "saves": -1}',
        b'{"event_type": "save", "step": 5, "wall_time": 1.0, "reason": "' + b"x" * 5000 + b'"}',
        b"[" * 100_000 + b"]" * 100_000,  # deeper than the parser recurses
        b"\xff\xfe not utf-8",
    ],
)
def test_a_bad_line_is_skipped_and_counted(tmp_path: Path, line: bytes) -> None:
    good = json.dumps(GOOD).encode()
    (tmp_path / JOURNAL_NAME).write_bytes(good + b"\n" + line + b"\n" + good + b"\n")
    records, skipped = read_journal(tmp_path)
    assert (len(records), skipped) == (2, 1)
    report = build_report(tmp_path)  # still a report, from the good lines
    assert report.skipped_lines == 1 and report.blocking_s == 1.0


def test_a_journal_that_is_not_a_regular_file_is_a_one_line_error(tmp_path: Path, capsys: object) -> None:
    target = tmp_path / "elsewhere.jsonl"
    target.write_text(json.dumps(GOOD) + "\n")
    root = tmp_path / "root"
    root.mkdir()
    (root / JOURNAL_NAME).symlink_to(target)
    with pytest.raises(CheckpointError, match="cannot read the run journal"):
        build_report(root)
    (root / JOURNAL_NAME).unlink()
    os.mkfifo(root / JOURNAL_NAME)  # never opened for a blocking read: no hang
    assert cli(["report", str(root)]) == 2
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert err.count("\n") == 1 and "not a regular file" in err and "Traceback" not in err


def test_a_journal_too_large_is_not_read(tmp_path: Path) -> None:
    with open(tmp_path / JOURNAL_NAME, "wb") as f:
        f.truncate(10 << 20)  # sparse: 10 MB of zeros, planted
    with pytest.raises(OSError, match="larger than"):
        read_journal(tmp_path, limit=1 << 20)


def test_a_hostile_progress_file_is_ignored(tmp_path: Path) -> None:
    for raw in (
        b"",
        b"{",
        b'{"step": "3", "wall_time": 1}',
        b'{"step": 3}',
        b"[3]",
        b'{"step": 3, "wall_time": -1}',
    ):
        (tmp_path / PROGRESS_NAME).write_bytes(raw)
        assert read_progress(tmp_path) is None, raw
    (tmp_path / PROGRESS_NAME).unlink()
    (tmp_path / PROGRESS_NAME).symlink_to("/etc/hostname")
    assert read_progress(tmp_path) is None
    # The manager, as the root's owner, does not write through it either: the journal stops, training goes on.
    with safepoint.CheckpointManager(tmp_path) as mgr:
        mgr.maybe_save(1, safepoint.TrainState(model=torch.nn.Linear(2, 2)))
    assert (tmp_path / PROGRESS_NAME).is_symlink() and Path("/etc/hostname").read_text()


def test_the_journal_is_bounded_and_keeps_its_totals(tmp_path: Path) -> None:
    journal = Journal(tmp_path, max_bytes=8192)
    journal.open()
    for step in range(1, 301):
        journal(
            ev.CheckpointEvent(
                ev.SAVE, step, wall_time=float(step), checkpoint_manager_blocking_duration_secs=0.25
            )
        )
        journal(
            ev.CheckpointEvent(
                ev.SAVE_COMMITTED, step, wall_time=float(step) + 0.5, bytes_written=10, bytes_skipped=7
            )
        )
    journal(ev.CheckpointEvent(ev.SAVE_BEGIN, 301, wall_time=400.0))  # not a journaled kind
    journal(ev.CheckpointEvent(ev.SAVE, 302, rank=1, wall_time=400.0))  # another rank's: not journaled
    journal.close()
    assert (tmp_path / JOURNAL_NAME).stat().st_size <= 8192
    records, skipped = read_journal(tmp_path)
    assert skipped == 0 and records[0]["event_type"] == CARRY and records[-1]["step"] == 300
    report = build_report(tmp_path)
    assert report.saves == 300 and report.blocking_s == pytest.approx(75.0) and report.bytes_saved == 3000
    assert report.bytes_skipped == 2100  # incremental saves' linked bytes: summed through the carry too
    assert report.to_json()["bytes_skipped"] == 2100
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_only_the_owner_writes_the_journal(tmp_path: Path) -> None:
    state = safepoint.TrainState(model=torch.nn.Linear(2, 2))
    with safepoint.CheckpointManager(tmp_path) as owner:
        owner.save(1, state)
        before = {
            p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith((".journal", ".att"))
        }
        with pytest.raises(safepoint.LeaseError):  # the root is taken: this start writes nothing
            safepoint.CheckpointManager(tmp_path)
        after = {
            p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith((".journal", ".att"))
        }
        assert after == before and JOURNAL_NAME in before
    records, skipped = parse_journal((tmp_path / JOURNAL_NAME).read_bytes())
    kinds = [r["event_type"] for r in records]
    assert skipped == 0 and kinds == [
        ev.SAVE_COMMITTED,
        ev.SAVE_DURABLE,
        ev.SAVE,
    ]  # no maybe_save: no progress
