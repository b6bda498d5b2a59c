"""safepoint's own files in ROOT (``.lease``, ``.attempts.json``, ``.uploads.json``) are opened as regular
files only: a symlink is never followed, a FIFO never hangs, a device is never read, a directory is never
moved (docs/reliability.md, "Threat model"). And a stale lease is taken over only if the file moved aside
is the one judged stale, never a fresh lease another contender linked in meanwhile.

Whatever could hang before the fix (a FIFO) runs in a child process with a timeout (forked from the fork
server: tests/helpers/example_runs.py ``run_job``): the test fails instead of
hanging the suite."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import safepoint
from safepoint.store.file_lease import MAX_LEASE_BYTES, Lease
from tests.helpers.example_runs import run_job

JOB = ["-m", "tests.store._own_files_job"]  # forked from the fork server: a real process, not a fresh
# interpreter (what is tested is how safepoint opens its own files, not the interpreter's start)


def _open_manager(root: Path, auto: bool = False) -> str:
    # timeout: a failsafe, before the fix a FIFO blocked the open forever (the child is killed on it)
    done = run_job([*JOB, "open", str(root), "auto" if auto else "-"], timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _save_steps(root: Path, *steps: int) -> None:
    with safepoint.CheckpointManager(root) as mgr:
        for step in steps:
            mgr.save(step, safepoint.TrainState(model=torch.nn.Linear(2, 2)))


def test_a_fifo_lease_is_refused_with_one_clear_line(root: Path) -> None:
    root.mkdir()
    os.mkfifo(root / ".lease")
    out = _open_manager(root)
    assert out.startswith("refused:") and "is a FIFO, not a regular file" in out, out
    assert "remove it by hand" in out and len(out.splitlines()) == 1
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".lease")) == [".lease"]


def test_a_fifo_attempts_file_does_not_hang_an_adaptive_manager(root: Path) -> None:
    root.mkdir()
    os.mkfifo(root / ".attempts.json")
    assert _open_manager(root, auto=True) == "restored 0"  # nothing to restore: starts at 0


def test_a_fifo_uploads_file_is_ignored(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / ".uploads.json")
    done = run_job([*JOB, "uploads", str(tmp_path)], timeout=120)
    assert done.stdout.strip() == "[]" and "ignoring unreadable" in done.stderr, done.stderr


def test_a_lease_symlinked_outside_root_is_never_followed_nor_judged_stale(
    root: Path, tmp_path: Path
) -> None:
    _save_steps(root, 1, 2, 3)
    outside = tmp_path / "hostname"  # old, and shaped like a dead holder's lease on another host
    outside.write_text(json.dumps({"host": "nodeX", "pid": 7, "heartbeat": 1.0, "token": "old"}))
    os.utime(outside, (1, 1))
    (root / ".lease").symlink_to(outside)
    done = run_job(["-m", "safepoint.cli", "prune", str(root), "--keep-last", "1"], timeout=120)
    assert done.returncode != 0 and "is a symlink, not a regular file" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        "step-1",
        "step-2",
        "step-3",
    ]
    assert (root / ".lease").is_symlink() and outside.exists()


def test_a_lease_that_is_a_device_or_directory_is_refused_and_left_alone(root: Path) -> None:
    root.mkdir()
    (root / ".lease").mkdir()
    with pytest.raises(safepoint.LeaseError, match="is a directory, not a regular file") as e:
        Lease(root).acquire()
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in root.iterdir()) == [".lease"]  # no .lease.stale-* left behind
    (root / ".lease").rmdir()
    (root / ".lease").symlink_to("/dev/zero")
    with pytest.raises(safepoint.LeaseError, match="symlink"):
        Lease(root).acquire()
    assert sorted(p.name for p in root.iterdir()) == [".lease"]


def test_an_oversized_lease_is_not_read_past_the_cap(root: Path) -> None:
    root.mkdir()
    big = b'{"pad": "' + b"x" * (MAX_LEASE_BYTES + 10) + b'"}'  # valid JSON, just too big
    (root / ".lease").write_bytes(big)
    lease = Lease(root)
    with pytest.raises(Exception, match=f"larger than {MAX_LEASE_BYTES} bytes"):
        lease._read()


class _PausedAfterRead(Lease):
    """A contender that stops right after reading the stale lease, until told to go on."""

    def __init__(self, root: Path, **kw: Any) -> None:
        super().__init__(root, **kw)
        self.read_done, self.go = threading.Event(), threading.Event()

    def _read(self) -> Any:
        found = super()._read()
        if not self.read_done.is_set():
            self.read_done.set()
            self.go.wait()
        return found


def test_takeover_moves_aside_only_the_lease_it_judged_stale(root: Path) -> None:
    root.mkdir()
    (root / ".lease").write_text(json.dumps({"host": "nodeX", "pid": 7, "heartbeat": 1.0, "token": "old"}))
    os.utime(root / ".lease", (1, 1))
    a = _PausedAfterRead(root, stale_after_s=4)
    b = Lease(root, stale_after_s=4)
    failure: list[BaseException] = []

    def take() -> None:
        try:
            a.acquire()
        except BaseException as e:
            failure.append(e)

    t = threading.Thread(target=take)
    t.start()
    try:
        assert a.read_done.wait(60)
        b.acquire()  # B takes the same stale lease over first
    finally:
        a.go.set()
        t.join(60)
    try:
        assert len(failure) == 1 and isinstance(failure[0], safepoint.LeaseError), failure
        assert json.loads((root / ".lease").read_text())["token"] == b.token
        b.fence("committing step 5")  # B still owns the root
        assert sorted(p.name for p in root.iterdir()) == [".lease"]
    finally:
        b.release()


@pytest.mark.parametrize(
    "record",
    [
        {"start": 1.0, "end": "soon", "outcome": "closed"},
        {"start": 1.0, "end": float("inf"), "outcome": "closed"},
        {"start": True, "outcome": "closed"},
        {"start": 1.0, "outcome": ["closed"]},
        {"start": 10**400, "outcome": "closed"},  # an int no float can hold: math.isfinite overflows
        "deep",
    ],
)
def test_a_malformed_attempts_record_is_ignored_not_a_failed_start(
    root: Path, record: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # .attempts.json is advice for the adaptive interval: a record summarize() cannot read (or JSON too
    # deep to parse) means the history starts over, never a traceback from the constructor.
    root.mkdir()
    path = root / ".attempts.json"
    if record == "deep":
        path.write_text('{"version": 1, "attempts": ' + "[" * 100_000 + "]" * 100_000 + "}")
    else:
        path.write_text(json.dumps({"version": 1, "attempts": [record]}))
    with safepoint.CheckpointManager(root, save_every_seconds="auto") as mgr:
        assert mgr.save(1, safepoint.TrainState(model=torch.nn.Linear(2, 2))) is not None
    assert f"ignoring unreadable {path}" in caplog.text
