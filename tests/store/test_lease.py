"""One live writer per root: a second one gets a clear error naming the holder; a dead one's lease is taken
over; read-only use needs no lease."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import safepoint
from safepoint.store.file_lease import Lease
from safepoint.store.heartbeat import UNREADABLE_WAIT_S, namespace_identity
from safepoint.store.posix_layout import Layout
from tests.conftest import REPO
from tests.helpers.example_runs import spawn_job


def test_second_live_writer_is_refused_in_process(root: Path) -> None:
    with safepoint.CheckpointManager(root):
        # A second manager is refused before it reaches the lease (tests/test_traps.py); the lease itself
        # refuses a second holder in this process too.
        with pytest.raises(safepoint.LeaseError, match="already held by another open CheckpointManager"):
            safepoint.CheckpointManager(root)
        with pytest.raises(safepoint.LeaseError, match=rf"in use by pid {os.getpid()} on host"):
            Layout(root).lease(120.0).acquire()
    # Released on close: a new owner is fine.
    safepoint.CheckpointManager(root).close()


def test_live_writer_in_another_process_is_refused(root: Path) -> None:
    # The holder is forked from the suite's fork server (its own process; a fresh start is not the subject).
    code = f"import safepoint, time; m = safepoint.CheckpointManager({str(root)!r}); print('ok', flush=True); time.sleep(600)"
    r, w = os.pipe()
    try:
        holder = spawn_job(["-c", code], w, 2)
    finally:
        os.close(w)
    with os.fdopen(r) as out:
        try:
            assert out.readline().strip() == "ok"
            with pytest.raises(
                safepoint.LeaseError, match=rf"pid {holder.pid} on host '{socket.gethostname()}'"
            ):
                safepoint.CheckpointManager(root)
            # Read-only use needs no lease.
            assert Layout(root).committed_steps() == []
        finally:
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait(timeout=30)


def test_stale_lease_of_dead_process_is_taken_over(root: Path) -> None:
    # A real process that held the lease and died without releasing it (SIGKILL).
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import os, signal, safepoint; m = safepoint.CheckpointManager({str(root)!r}); "
            "m.save(1, safepoint.TrainState(rng=False, extra={'a': 1})); os.kill(os.getpid(), signal.SIGKILL)",
        ],
        env=dict(os.environ, PYTHONPATH=str(REPO / "src")),
    )
    # Not reaped yet (a zombie, as a killed rank is until its parent or init reaps it, seconds in a
    # container): its pid still answers kill(pid, 0), but it is dead and a restart takes over at once.
    deadline = time.monotonic() + 300  # generous: a start of torch on a loaded 2-core machine took over 60 s
    while Path(f"/proc/{proc.pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z":
        assert time.monotonic() < deadline, "the holder never died"
        time.sleep(0.05)
    lease = json.loads((root / ".lease").read_text())
    assert lease["pid"] == proc.pid and lease["host"] == socket.gethostname()
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.latest_step() == 1
        assert json.loads((root / ".lease").read_text())["pid"] == os.getpid()
    assert proc.wait(timeout=60) == -9


def test_stale_lease_from_other_host_by_heartbeat(root: Path) -> None:
    # The heartbeat is the lease file's mtime (touched by the holder through its own descriptor).
    root.mkdir(parents=True)
    rec = {"host": "elsewhere", "pid": 1, "heartbeat": 0.0, "token": "x"}
    (root / ".lease").write_text(json.dumps(rec))
    os.utime(root / ".lease", (0.0, 0.0))
    safepoint.CheckpointManager(root).close()

    (root / ".lease").write_text(json.dumps(rec))  # touched just now: a live holder elsewhere
    with pytest.raises(safepoint.LeaseError, match="host 'elsewhere'"):
        safepoint.CheckpointManager(root)


def test_lease_error_is_a_checkpoint_error_and_exception() -> None:
    assert issubclass(safepoint.LeaseError, safepoint.CheckpointError)
    assert issubclass(safepoint.CheckpointError, Exception)


def test_unwritable_root_gives_clear_error(tmp_path: Path) -> None:
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(safepoint.CheckpointError, match="cannot create checkpoint root"):
        safepoint.CheckpointManager(f / "sub")
    torch.manual_seed(0)


# ---- records that cannot be trusted: no heartbeat, unreadable files, files that vanish ------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


@pytest.mark.parametrize("beat", [None, "garbled", [1.0]])
def test_dead_same_host_lease_with_unusable_heartbeat_is_taken_over(root: Path, beat: object) -> None:
    root.mkdir(parents=True)
    rec = {"host": socket.gethostname(), "pid": _dead_pid(), "heartbeat": beat, "token": "x"}
    (root / ".lease").write_text(json.dumps(rec))
    safepoint.CheckpointManager(root).close()  # was: TypeError/ValueError from float(heartbeat)


def test_unusable_heartbeat_from_another_host_counts_as_stale(root: Path) -> None:
    root.mkdir(parents=True)
    (root / ".lease").write_text(json.dumps({"host": "elsewhere", "pid": 1, "heartbeat": None, "token": "x"}))
    safepoint.CheckpointManager(root).close()


def test_live_holder_without_readable_heartbeat_is_named(root: Path) -> None:
    root.mkdir(parents=True)
    boot, pid_ns = namespace_identity()  # what every record safepoint writes says: this pid can be asked
    rec = {"host": socket.gethostname(), "pid": os.getpid(), "heartbeat": "?", "token": "someone-else"}
    (root / ".lease").write_text(json.dumps({**rec, "boot_id": boot, "pid_ns": pid_ns}))
    with pytest.raises(
        safepoint.LeaseError, match=rf"pid {os.getpid()} on host .*no readable lease heartbeat"
    ):
        safepoint.CheckpointManager(root)


def _swap_in(path: Path, make: Callable[[Path], object]) -> None:
    """Replace ``path`` atomically (rename over it) by what ``make`` creates: the heartbeat never sees it
    missing."""
    tmp = path.with_name(f"swap-{uuid.uuid4().hex}")
    make(tmp)
    os.replace(tmp, path)


def _wait_for(what: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll ``what`` until true; a generous bound only against a hang (no test relies on its length)."""
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _beats(lease: Lease, n: int) -> None:
    """Wait until ``n`` more heartbeats were attempted."""
    target = lease.beats + n
    _wait_for(lambda: lease.beats >= target)


def test_heartbeat_rides_out_an_unreadable_lease_and_names_a_real_taker(tmp_path: Path) -> None:
    lease = Lease(tmp_path, stale_after_s=30, heartbeat_s=0.02)
    lease.acquire()
    try:
        good = lease.path.read_text()
        unreadable_dir = tmp_path / "a-directory"
        unreadable_dir.mkdir()
        # EISDIR on every read (an OSError, as EIO/ESTALE on NFS), then a truncated record (not JSON):
        for make in (lambda p: os.symlink(unreadable_dir, p), lambda p: p.write_text('{"host": "x", "pi')):
            _swap_in(lease.path, make)
            _beats(lease, 5)  # each failing to read it
            assert lease.lost is None
            lease.check()
            _swap_in(lease.path, lambda p: p.write_text(good))
            os.utime(lease.path, (0.0, 0.0))
            _wait_for(lambda: lease.path.stat().st_mtime > 0.0)  # renewed: touched again
        # Another owner: lost, and the message names it.
        rec = {"host": "elsewhere", "pid": 4242, "heartbeat": time.time(), "token": "theirs"}
        _swap_in(lease.path, lambda p: p.write_text(json.dumps(rec)))
        _wait_for(lambda: lease.lost is not None)
        assert lease.lost is not None and "taken over by pid 4242 on host 'elsewhere'" in lease.lost
        with pytest.raises(safepoint.LeaseError, match="pid 4242"):
            lease.check()
    finally:
        lease.release()
    assert json.loads(lease.path.read_text())["token"] == "theirs"  # not ours to remove


class _TakenOverMidRenewal(Lease):
    """Another job takes the lease over (renames it aside, links its own) right after this owner's
    heartbeat has read its record and found its token: the window of issue 13's finding 3."""

    armed = False
    theirs = {"host": "elsewhere", "pid": 4242, "heartbeat": 0.0, "token": "theirs"}

    def _take_over(self) -> None:
        self.armed = False
        aside = self.path.with_name(".lease.stale-taker")
        os.rename(self.path, aside)
        os.unlink(aside)
        tmp = self.path.with_name(".lease.taker.tmp")
        tmp.write_text(json.dumps(self.theirs))
        os.link(tmp, self.path)
        tmp.unlink()

    def _read(self) -> Any:  # the heartbeat's read before this fix
        found = super()._read()
        if self.armed:
            self._take_over()
        return found

    def _parse(self, path: Path, fd: int) -> dict[str, Any]:  # the heartbeat's read now
        record = Lease._parse(path, fd)
        if self.armed:
            self._take_over()
        return record


def test_renewal_never_overwrites_a_takeover_between_its_read_and_its_write(tmp_path: Path) -> None:
    lease = _TakenOverMidRenewal(tmp_path, stale_after_s=30, heartbeat_s=0.02)
    lease.acquire()
    try:
        lease.armed = True
        _wait_for(lambda: lease.lost is not None)
        assert "taken over by pid 4242 on host 'elsewhere'" in (lease.lost or "")
        assert json.loads(lease.path.read_text())["token"] == "theirs"  # the taker's lease stands
        with pytest.raises(safepoint.LeaseError, match="pid 4242"):
            lease.fence("committing step 2")
    finally:
        lease.release()
    assert json.loads(lease.path.read_text())["token"] == "theirs"  # and release leaves it alone


@pytest.mark.parametrize("stale", [0, -1, float("nan"), float("inf"), 30.0, "60"])
def test_lease_staleness_must_exceed_twice_the_heartbeat(tmp_path: Path, stale: Any) -> None:
    with pytest.raises(ValueError, match="lease"):
        Lease(tmp_path, stale_after_s=stale, heartbeat_s=15.0)
    if stale != 30.0:  # the manager derives its heartbeat (a quarter of the limit at most)
        with pytest.raises(ValueError, match="lease_stale_after_s"):
            cluster = safepoint.ClusterOptions(lease_stale_after_s=stale)
            safepoint.CheckpointManager(tmp_path / "ckpt", cluster=cluster)
    assert not (tmp_path / "ckpt").exists()  # refused before touching the root


def test_manager_heartbeat_is_a_quarter_of_a_short_staleness_limit(root: Path) -> None:
    with safepoint.CheckpointManager(root, cluster=safepoint.ClusterOptions(lease_stale_after_s=2.0)) as mgr:
        assert mgr._lease.heartbeat_s == 0.5
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr._lease.heartbeat_s == 15.0


def test_heartbeat_gives_up_once_unreadable_for_longer_than_the_staleness_limit(tmp_path: Path) -> None:
    lease = Lease(tmp_path, stale_after_s=0.3, heartbeat_s=0.02)
    lease.acquire()
    try:
        _swap_in(lease.path, lambda p: p.write_text(""))
        _wait_for(lambda: lease.lost is not None)
        assert lease.lost is not None and "longer than lease_stale_after_s=0.3s" in lease.lost
        assert "None" not in lease.lost
    finally:
        lease.release()


def test_removed_lease_is_lost_with_a_clear_reason(tmp_path: Path) -> None:
    lease = Lease(tmp_path, stale_after_s=30, heartbeat_s=0.02)
    lease.acquire()
    try:
        lease.path.unlink()
        _wait_for(lambda: lease.lost is not None)
        assert lease.lost is not None and "was removed" in lease.lost and "None" not in lease.lost
    finally:
        lease.release()


class _VanishingLease(Lease):
    """A holder that releases the lease right between our failed O_EXCL create and our read of it."""

    vanished = False

    def _read(self) -> dict[str, Any] | None:
        if not self.vanished and self.path.exists():
            self.vanished = True
            self.path.unlink()
        return super()._read()


def test_acquire_retries_when_the_holder_releases_in_between(tmp_path: Path) -> None:
    holder = Lease(tmp_path)
    holder.acquire()
    holder._stop.set()  # its heartbeat ends; the file stays (it is "released" by the race below)
    lease = _VanishingLease(tmp_path)
    lease.acquire()  # was: LeaseError "in use by pid None on host None"
    try:
        assert lease.vanished and json.loads(lease.path.read_text())["token"] == lease.token
    finally:
        lease.release()


def test_unreadable_lease_is_retried_then_refused_without_naming_pid_none(tmp_path: Path) -> None:
    (tmp_path / ".lease").write_text("")  # a creator between its O_EXCL create and its write, or EIO
    t0 = time.monotonic()
    with pytest.raises(safepoint.LeaseError, match="cannot read the lease") as info:
        Lease(tmp_path, stale_after_s=60).acquire()
    assert time.monotonic() - t0 >= UNREADABLE_WAIT_S * 0.9  # re-read for a while first
    assert "None" not in str(info.value)
    # Unchanged for longer than the staleness limit: taken over.
    old = time.time() - 120
    os.utime(tmp_path / ".lease", (old, old))
    lease = Lease(tmp_path, stale_after_s=60)
    lease.acquire()
    lease.release()


def test_the_fence_parses_only_bytes_it_has_not_parsed_and_sees_a_token_changed_in_place(root: Path) -> None:
    """The fence (before every commit and delete) reuses the record of lease bytes equal to the last ones
    parsed (store/file_lease.py ``_parse``); a takeover whose record differs only in its token, the same
    length, rewritten in place (same inode, so no stat tells it), is still seen, and what the cache hands
    out is a copy."""
    root.mkdir()
    lease = Layout(root).lease(120.0)
    lease.acquire()
    try:
        lease.fence("committing")
        first = lease._holder()
        assert first is not None and Lease._last_parsed is not None
        first["token"] = "changed by a caller"
        assert lease._holder() == Lease._last_parsed[1] != first  # the cache's own record, untouched
        raw = (root / ".lease").read_bytes()
        token = str(lease.token)
        other = token[:-1] + ("0" if token[-1] != "0" else "1")
        with open(root / ".lease", "r+b") as f:  # the same length, in place
            f.write(raw.replace(token.encode(), other.encode()))
        with pytest.raises(safepoint.LeaseError, match="taken over"):
            lease.fence("committing step 2")
    finally:
        lease.release()  # the heartbeat joined; the taker's lease is not ours: left in place
