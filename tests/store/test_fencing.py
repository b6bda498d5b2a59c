"""Fencing: only the lease holder commits or deletes. A job frozen (SIGSTOP) inside a save after its lease
check, whose root another job took over meanwhile, must fail that save when it resumes, and the new owner's
checkpoints must stay intact (issue 13, finding 2). Real processes, a real second host (a UTS namespace of its own)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import safepoint
from safepoint.store import heartbeat
from safepoint.store.posix_layout import Layout
from safepoint.tiers.base import ReadOnlyRootWarning
from tests.helpers.example_runs import PipedJob
from tests.helpers.s3 import storage_options

STALE_S = 2.0  # short, so B takes over quickly; A is frozen, so no heartbeat of A's can interfere

# Job A: saves step 1, then step 2; step 2's capture announces itself and waits for a line on stdin (the
# test freezes A there, after the lease check at the start of save), then A finishes the save.
JOB_A = textwrap.dedent(
    """
    import sys, safepoint
    root, mode = sys.argv[1], sys.argv[2]

    class Gate:
        calls = 0
        def state_dict(self):
            Gate.calls += 1
            if Gate.calls > 1:  # the first call is TrainState's sharded-tensor check when it is built
                print("capturing", flush=True)
                sys.stdin.readline()
            return {"who": "A"}
        def load_state_dict(self, sd):
            pass

    kw = {} if mode == "sync" else {"async_save": True, "writer": safepoint.WriterOptions(async_writer=mode)}
    cluster = safepoint.ClusterOptions(lease_stale_after_s=STALE)
    mgr = safepoint.CheckpointManager(root, cluster=cluster, **kw)
    mgr.save(1, safepoint.TrainState(rng=False, extra={"who": "A"}))
    mgr.wait()
    try:
        mgr.save(2, safepoint.TrainState(rng=False, extra={"gate": Gate()}))
        mgr.wait()
        print("A: committed", flush=True)
    except safepoint.CheckpointError as e:
        print(f"A: refused: {type(e).__name__}: {e}", flush=True)
    try:
        mgr.close()
    except safepoint.CheckpointError:
        pass
    """
).replace("STALE", repr(STALE_S))

# Job B, on another host: waits for A's lease to go stale, takes the root over, commits steps 2 and 3,
# then holds the lease until told to finish.
JOB_B = textwrap.dedent(
    """
    import socket, sys, time, safepoint
    root = sys.argv[1]
    deadline = time.monotonic() + 120
    while True:
        try:
            mgr = safepoint.CheckpointManager(root, cluster=safepoint.ClusterOptions(lease_stale_after_s=STALE))
            break
        except safepoint.LeaseError:
            assert time.monotonic() < deadline, "the lease of job A never went stale"
            time.sleep(0.1)
    for step in (2, 3):
        mgr.save(step, safepoint.TrainState(rng=False, extra={"who": "B"}))
    print("B: committed on", socket.gethostname(), flush=True)
    sys.stdin.readline()
    mgr.close()
    """
).replace("STALE", repr(STALE_S))


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--uts", "true"], capture_output=True)
    return probe.returncode == 0


needs_second_host = pytest.mark.skipif(
    not _unshare_works(), reason="needs `unshare --uts` (root, Linux) to run job B as another host"
)


def _spawn(argv: list[str], hostname: str | None = None) -> PipedJob:
    """``python ARGV`` with pipes to its stdin and stdout, forked from the suite's fork server (a fresh
    interpreter is not the subject: ~4.5 s of CPU each); ``hostname``: as its own host (a UTS namespace, as
    ``unshare --uts`` and ``hostname`` give)."""
    return PipedJob(argv, hostname=hostname)


def freeze(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it has stopped: kill() returns before a thread
    running on another core has (one was seen reading the next line of its stdin 6 ms later)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while True:
        states = set()
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                states.add(f.read().rsplit(b")", 1)[1].split()[0])
        if states <= {b"T", b"t"}:
            return
        assert time.monotonic() < deadline, f"pid {pid} never stopped: {states}"
        time.sleep(0.001)


def _line(proc: PipedJob) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline().strip()


@needs_second_host
# The writer thread's commit runs the same fenced code as the sync saver's; it runs under -m slow.
@pytest.mark.parametrize(
    "mode",
    ["sync", pytest.param("thread", marks=pytest.mark.slow), pytest.param("process", marks=pytest.mark.slow)],
)
def test_a_stale_owner_frozen_inside_save_never_commits_over_the_new_owner(root: Path, mode: str) -> None:
    a = _spawn(["-c", JOB_A, str(root), mode])
    b: PipedJob | None = None
    try:
        assert _line(a) == "capturing"
        freeze(a.pid)  # frozen inside save(2), after its lease check
        assert a.stdin is not None
        a.stdin.write("go\n")  # read once A runs again
        a.stdin.flush()
        job_b = root.parent / "job_b.py"
        job_b.write_text(JOB_B)
        b = _spawn([str(job_b), str(root)], hostname="nodeB")
        assert _line(b) == "B: committed on nodeB"
        before = {s: (root / f"step-{s}" / "safepoint.json").read_bytes() for s in (2, 3)}
        os.kill(a.pid, signal.SIGCONT)
        out = _line(a)
        assert out.startswith("A: refused: "), out
        assert "taken over by" in out and "nodeB" in out, out
        assert a.wait(timeout=60) == 0
        # B's checkpoints are untouched, and B still owns the root.
        assert {s: (root / f"step-{s}" / "safepoint.json").read_bytes() for s in (2, 3)} == before
        assert json.loads((root / ".lease").read_text())["host"] == "nodeB"
    finally:
        if b is not None:
            if b.stdin is not None:
                b.stdin.write("done\n")
                b.stdin.close()
            b.wait(timeout=60)
        if a.poll() is None:
            os.kill(a.pid, signal.SIGCONT)
            a.kill()
            a.wait()
    for step in (2, 3):
        state = safepoint.TrainState(rng=False, extra={"who": None})
        with safepoint.CheckpointManager(root) as mgr:
            assert mgr.restore(state, step=step) == step
        assert state.extra == {"who": "B"}


def _take_over(lease_path: Path) -> None:
    """What another job's takeover does: the old file renamed aside, a new record linked in its place."""
    os.rename(lease_path, lease_path.with_name(".lease.stale-x"))
    tmp = lease_path.with_name(".lease.x.tmp")
    tmp.write_text(json.dumps({"host": "nodeB", "pid": 7, "heartbeat": 0.0, "token": "theirs"}))
    os.link(tmp, lease_path)


@pytest.fixture
def no_beat(monkeypatch: pytest.MonkeyPatch) -> safepoint.ClusterOptions:
    """Cluster options whose lease heartbeat never beats within a test. These tests take the lease over
    behind the manager's back and expect the *commit fence* to refuse: a heartbeat landing between the
    takeover and the save (15 s after the manager started; a loaded machine gets there) would notice first
    and refuse the save at its start instead, which is right but is not what these tests check."""
    monkeypatch.setattr(heartbeat, "HEARTBEAT_S", 86400.0)
    return safepoint.ClusterOptions(lease_stale_after_s=4 * 86400.0)


def test_deletes_and_commits_are_fenced_by_the_lease_on_disk(
    root: Path, no_beat: safepoint.ClusterOptions
) -> None:
    with safepoint.CheckpointManager(root, keep=safepoint.Keep(last=1), cluster=no_beat) as mgr:
        mgr.save(1, safepoint.TrainState(rng=False, extra={"n": 1}))
        layout = mgr.layout
        assert isinstance(layout, Layout)
        _take_over(root / ".lease")
        with pytest.raises(safepoint.SaveError, match="not committing step 2: .*taken over by pid 7"):
            mgr.save(2, safepoint.TrainState(rng=False, extra={"n": 2}))
        assert not (root / "step-2").exists()
        with pytest.raises(safepoint.LeaseError, match="not deleting step 1: .*taken over by pid 7"):
            layout.remove(1)
        assert (root / "step-1" / "safepoint.json").exists()
        with contextlib.suppress(safepoint.CheckpointError):
            mgr.close()


def test_a_deleted_root_is_never_recreated_and_committed_to_without_a_lease(root: Path) -> None:
    # issue 13, finding 10: the root deleted while an async save runs; the next save must not commit into
    # a recreated root that no lease guards.
    mgr = safepoint.CheckpointManager(
        root, async_save=True, writer=safepoint.WriterOptions(async_writer="thread")
    )
    try:
        mgr.save(1, safepoint.TrainState(rng=False, extra={"n": 1}))
        mgr.wait()  # (deleting while the writer creates files races rmtree itself, not safepoint)
        shutil.rmtree(root)
        with pytest.raises(safepoint.CheckpointError, match="lease .* was removed"):
            mgr.save(2, safepoint.TrainState(rng=False, extra={"n": 2}))
            mgr.wait()
        assert not (root / "step-2").exists()
        assert not (root / ".lease").exists()
    finally:
        with contextlib.suppress(safepoint.CheckpointError):
            mgr.close()


def test_s3_commits_and_deletes_are_fenced(
    moto_endpoint: str, bucket: str, no_beat: safepoint.ClusterOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    import boto3

    from safepoint.tiers import journal_mirror

    url, opts = f"s3://{bucket}/run", storage_options(moto_endpoint)
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    theirs: dict[str, Any] = {"host": "nodeB", "pid": 7, "heartbeat": 0.0, "token": "theirs"}
    # The run journal's mirror reads the lease before each copy (fenced like every write): a copy after
    # the takeover below would find the lease lost first, and save 2 be refused before it writes (also
    # safe, but not the commit fence this test is about). So its one copy (after step 1's commit) is
    # waited for, and no periodic one comes during the test. (A CI run with three workers hit that race.)
    monkeypatch.setattr(journal_mirror, "DEFAULT_INTERVAL_S", 3600.0)
    mgr = safepoint.CheckpointManager(url, storage_options=opts, cluster=no_beat)
    try:
        mgr.save(1, safepoint.TrainState(rng=False, extra={"n": 1}))
        deadline = time.monotonic() + 120
        while s3.list_objects_v2(Bucket=bucket, Prefix="run/.run/").get("KeyCount", 0) == 0:
            assert time.monotonic() < deadline, "the journal mirror never copied after step 1's commit"
            time.sleep(0.05)
        s3.put_object(Bucket=bucket, Key="run/.lease", Body=json.dumps(theirs).encode())
        with pytest.raises(safepoint.SaveError, match="not committing step 2: .*taken over by pid 7"):
            mgr.save(2, safepoint.TrainState(rng=False, extra={"n": 2}))
        with pytest.raises(safepoint.LeaseError, match="not deleting step 1: .*taken over by pid 7"):
            mgr.layout.remove(1)
        keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="run/")["Contents"]}
        assert "run/step-1/safepoint.json" in keys and "run/step-2/safepoint.json" not in keys
    finally:
        with contextlib.suppress(safepoint.CheckpointError):
            mgr.close()
    assert json.loads(s3.get_object(Bucket=bucket, Key="run/.lease")["Body"].read())["token"] == "theirs"


if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip(reason="Linux only (SIGSTOP, unshare, memfd)")


# ---- a root that cannot be written still restores (issue 13, finding 10) --------------------------------


@pytest.fixture
def tmpfs(tmp_path: Path) -> Any:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _save_one(root: Path) -> None:
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(5, safepoint.TrainState(rng=False, extra={"t": torch.arange(64.0)}))


def _restores_without_the_lease(root: Path, why: str) -> None:
    state = safepoint.TrainState(rng=False, extra={"t": torch.zeros(64)})
    with pytest.warns(ReadOnlyRootWarning, match=f"cannot take the lease .*{why}"):
        mgr = safepoint.CheckpointManager(root)
    with mgr:
        assert mgr.restore(state) == 5
        with pytest.raises(safepoint.LeaseError, match="not saving step 6: cannot take the lease"):
            mgr.save(6, state)
    assert torch.equal(state.extra["t"], torch.arange(64.0))  # type: ignore[index]


def test_a_read_only_root_restores_without_the_lease(tmpfs: Path) -> None:
    root = tmpfs / "ckpt"
    _save_one(root)
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    _restores_without_the_lease(root, "Read-only file system")


def test_a_full_disk_restores_without_the_lease(tmpfs: Path) -> None:
    root = tmpfs / "ckpt"
    _save_one(root)
    with open(tmpfs / "filler", "wb") as f, contextlib.suppress(OSError):
        while True:  # until ENOSPC
            f.write(b"\0" * (1 << 20))
            f.flush()
    with contextlib.suppress(OSError), open(tmpfs / "filler2", "wb") as f:
        f.write(b"\0" * (1 << 16))
        f.flush()
        os.fsync(f.fileno())
    _restores_without_the_lease(root, "No space left on device")


def test_an_emergency_save_on_a_read_only_root_is_a_lease_error(tmpfs: Path, tmp_path: Path) -> None:
    """The emergency save called the writer directly and failed with an OS error on a read-only root; it
    now refuses like save() does: a LeaseError, nothing saved, and the restart resumes from step 5."""
    root = tmpfs / "ckpt"
    _save_one(root)
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    flag = tmp_path / "preempt"
    state = safepoint.TrainState(rng=False, extra={"t": torch.zeros(64)})
    with pytest.warns(ReadOnlyRootWarning):
        mgr = safepoint.CheckpointManager(root, preemption=safepoint.PreemptionOptions(file=flag))
    try:
        assert mgr.restore(state) == 5
        flag.touch()
        deadline = time.monotonic() + 120  # the file is polled in the background: wait for its notice
        with pytest.raises(safepoint.Preempted) as info:
            step = 6
            while time.monotonic() < deadline:
                mgr.maybe_save(step, state)
                step += 1
                time.sleep(0.01)
        assert info.value.saved_step is None and info.value.resume_step == 5
        assert isinstance(info.value.__cause__, safepoint.LeaseError)
        assert "cannot take the lease" in str(info.value.__cause__)
    finally:
        with contextlib.suppress(safepoint.CheckpointError):
            mgr.close()
