"""The grace budget under tiering: nothing past the end of the grace, no store request within it that the
exit does not need, no false alarms, and no lease given up under a durable commit. Also: tier transfers
never strand a rank, and a bad argument leaks no process group.

Object-store cases run on moto's server behind the fault proxy (tests/helpers/s3.py), real s3fs over
HTTP; notices are real SIGTERMs to this process. Multi-rank cases run in child processes (gloo).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

import safepoint
from safepoint.dist import Comm
from safepoint.policy.history import TierEstimate
from safepoint.preempt.preemption import EmergencyPlan, Preemption
from safepoint.remote.object_layout import RemoteLayout
from tests.helpers.example_runs import run_job, spawn_job
from tests.helpers.s3 import FaultProxy, storage_options, tiered_manager
from tests.helpers.train import Setup, train_until_preempted


def _s3_manager(
    tmp_path: Path, proxy: FaultProxy, bucket: str, grace_seconds: float | None = None, **kw: Any
) -> safepoint.CheckpointManager:
    notices = safepoint.PreemptionOptions(signals=(signal.SIGTERM,), grace_seconds=grace_seconds)
    return tiered_manager(tmp_path, proxy, bucket, preemption=notices, **kw)


def _durable(proxy: FaultProxy, bucket: str) -> list[int]:
    return RemoteLayout(f"s3://{bucket}/run", storage_options(proxy.endpoint)).committed_steps()


def _let_the_abandoned_upload_go(mgr: safepoint.CheckpointManager, *, abandoned: bool = True) -> None:
    """After an abandon, no transfer thread may stay parked at the shut gate: interpreter exit joins the
    pools' workers, so one parked there forever would hang the job instead of exiting with the preempted
    code. They must leave by themselves (the gate stays shut). ``abandoned=False``: nothing was abandoned
    (nothing was uploading at the grace's end); no thread is parked either."""
    if abandoned:
        assert not mgr._tiers.durable.store.gate.is_set()  # type: ignore[attr-defined]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        parked = [
            tid
            for tid, frame in sys._current_frames().items()
            if any(f.f_code.co_name == "pass_gate" for f, _ in traceback.walk_stack(frame))
        ]
        if not parked:
            return
        time.sleep(0.05)
    raise AssertionError(f"threads still parked at the shut gate after an abandon: {parked}")


def _uploader_idle(mgr: safepoint.CheckpointManager, timeout: float = 30) -> bool:
    tiers: Any = mgr._tiers
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with tiers._cv:
            if tiers._busy is None and not tiers._queue:
                return True
        time.sleep(0.05)
    return False


def _lease_exists(moto_endpoint: str, bucket: str) -> bool:
    import boto3

    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    return "Contents" in s3.list_objects_v2(Bucket=bucket, Prefix="run/.lease")


def test_close_after_the_grace_does_not_abandon_an_idle_uploader(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The grace has run out before the notice is acted on; the uploader has nothing to do. close() must
    not report an upload as abandoned (nor skip the group's teardown, as it does after an abandon)."""
    caplog.set_level(logging.INFO, logger="safepoint")
    s = Setup()
    mgr = safepoint.CheckpointManager(
        tmp_path / "durable",  # a file:// durable tier
        local_root=tmp_path / "local",
        save_every_steps=5,
        preemption=safepoint.PreemptionOptions(signals=(signal.SIGTERM,), grace_seconds=0.3),
    )
    assert train_until_preempted(mgr, s, range(1, 6)) is None
    mgr.wait()  # step 5 is durable; the uploader thread idles
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)  # acted on 0.5 s after the notice: 0.2 s past the end of the grace
    with pytest.raises(safepoint.Preempted) as info:
        mgr.maybe_save(5, s.state())
    mgr.close()
    assert info.value.saved_step == 5
    assert "abandoned" not in caplog.text, caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert not mgr._tiers._grace.gave_up  # type: ignore[attr-defined]


def test_preemption_makes_no_store_request_and_exits_within_the_grace_when_the_store_is_down(
    tmp_path: Path, proxy: FaultProxy, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    """S3 answers nothing but 503s (or never answers) once the notice comes. Every rank used to list the
    durable tier and read its manifests for Preempted.resume_step, retrying with backoff, and then raised
    UploadError instead of Preempted; close() then spent the store's retries on releasing the lease."""
    grace = 2.0
    s = Setup()
    mgr = _s3_manager(tmp_path, proxy, bucket, grace_seconds=grace)
    assert train_until_preempted(mgr, s, range(1, 6)) is None
    mgr.wait()
    assert _durable(proxy, bucket) == [5]
    proxy.hold(path=r"/run/\.lease")  # releasing the lease would hang ...
    proxy.add("503")  # ... and everything else fails (retried with backoff, then UploadError)
    release = threading.Timer(30, proxy.release.set)
    release.start()
    try:
        mark = len(proxy.seen)
        caplog.set_level(logging.INFO, logger="safepoint")
        t0 = time.monotonic()
        e = train_until_preempted(mgr, s, range(6, 100), term_at=7)
        preempted_after = time.monotonic() - t0
        during = proxy.seen[mark:]
        with contextlib.suppress(safepoint.CheckpointError):  # the upload of step 7 may have failed by now
            mgr.close()
        closed_after = time.monotonic() - t0
    finally:
        release.cancel()
        proxy.clear()
        # The emergency plan uploads step 7 too when the last uploads were fast: that upload then meets
        # the 503s and is abandoned at the grace's end. When they were slow (a loaded machine: 2.4 s
        # expected against the 2 s grace), step 7 stays local-only and there is nothing to abandon.
        local_only = "not uploading step(s) [7]" in caplog.text
        _let_the_abandoned_upload_go(mgr, abandoned=not local_only)
    assert mgr._tiers._grace.gave_up is not local_only  # type: ignore[attr-defined]
    assert isinstance(e, safepoint.Preempted), e
    assert (e.step, e.saved_step, e.resume_step, e.code) == (7, 7, 7, 143)
    # No listing, no manifest read: only the uploader's own requests (it may start on step 7) went out.
    assert not [r for r in during if r[0] == "GET"], during
    assert preempted_after < 1.0, preempted_after
    assert closed_after < grace + 1.0, closed_after  # the lease's release did not outlive the grace
    assert "lease was not released by the end of the grace" in caplog.text


def test_abandon_waits_for_no_commit_and_never_releases_the_lease_under_one(
    tmp_path: Path, proxy: FaultProxy, bucket: str, moto_endpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The grace ends while step 5's manifest PUT is in flight. The commit cannot be abandoned (it may
    land), so close() says so, returns at the deadline, and leaves the lease to expire instead of deleting
    it under the commit; the commit then completes, as the log says it may."""
    caplog.set_level(logging.INFO, logger="safepoint")
    grace = 1.0
    s = Setup()
    mgr = _s3_manager(tmp_path, proxy, bucket, grace_seconds=grace)
    proxy.hold(method="PUT", path=r"/run/step-5/safepoint\.json", count=1)
    release = threading.Timer(30, proxy.release.set)
    release.start()
    try:
        assert train_until_preempted(mgr, s, range(1, 6)) is None
        assert proxy.held.wait(60), "the commit of step 5 never started"
        t0 = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(safepoint.Preempted):
            mgr.maybe_save(5, s.state())  # committed locally already: nothing saved again
        mgr.close()
        closed_after = time.monotonic() - t0
        assert closed_after < grace + 1.5, closed_after
        assert (
            "while step 5 is being committed on the durable tier: the commit is left running" in caplog.text
        )
        assert "abandoned (nothing is committed" not in caplog.text
        assert _lease_exists(moto_endpoint, bucket), "the lease was released under a commit in flight"
    finally:
        release.cancel()
        proxy.release.set()
        _let_the_abandoned_upload_go(mgr)
    deadline = time.monotonic() + 30
    while _durable(proxy, bucket) != [5] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _durable(proxy, bucket) == [5]


def test_no_commit_starts_after_an_abandon(
    tmp_path: Path, proxy: FaultProxy, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The grace ends while a data file is being uploaded: abandoned; when that request completes after
    all, nothing is committed on the durable tier."""
    caplog.set_level(logging.INFO, logger="safepoint")
    s = Setup()
    mgr = _s3_manager(tmp_path, proxy, bucket, grace_seconds=0.5)
    proxy.hold(method="PUT", path=r"/run/step-5/__0_0\.distcp", count=1)
    release = threading.Timer(30, proxy.release.set)
    release.start()
    try:
        assert train_until_preempted(mgr, s, range(1, 6)) is None
        assert proxy.held.wait(60)
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(safepoint.Preempted):
            mgr.maybe_save(5, s.state())
        mgr.close()
        assert "the upload of step 5 is still running: abandoned" in caplog.text
    finally:
        release.cancel()
        proxy.release.set()  # the held request completes ...
        _let_the_abandoned_upload_go(mgr)  # ... and the upload goes on as far as it may: not to a commit
    assert _uploader_idle(mgr)
    assert "abandoned at the preemption's grace deadline" in caplog.text  # the commit refused to start
    assert _durable(proxy, bucket) == []
    assert not [r for r in proxy.seen if r[0] == "PUT" and r[1].startswith(f"/{bucket}/run/step-5/safepoint")]


# ---- one rank fails with something unexpected: the others are not stranded ---------------------------

_MOVE_WORKER = """
import json, sys, time
import torch.distributed as dist
from safepoint.dist import Comm
from safepoint.tiers.transfer import move_and_commit

rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
comm = Comm(30.0)
out = {}

def move():
    if rank == 1:
        raise KeyError("a bug in rank 1's share")

t0 = time.monotonic()
try:
    moved = move_and_commit(
        comm, move, lambda _: out.setdefault("committed", True), lambda: out.setdefault("discarded", True)
    )
    out.update(problems=moved.problems, unexpected=moved.unexpected, error=repr(moved.error))
except BaseException as e:
    out["raised"] = repr(e)
out["elapsed"] = time.monotonic() - t0
print("RESULT " + json.dumps(out), flush=True)
comm.barrier()
comm.destroy()
dist.destroy_process_group()
"""


def test_an_unexpected_error_on_one_rank_does_not_strand_the_others(tmp_path: Path) -> None:
    store = tmp_path / "store"
    # Two processes forked from the fork server (tests/helpers/example_runs.py ``spawn_job``): real
    # processes and a real gloo group; what they start from is not what this test is about.
    logs = [tmp_path / f"rank{rank}.out" for rank in (0, 1)]
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(spawn_job(["-c", _MOVE_WORKER, str(rank), str(store)], out.fileno(), out.fileno()))
    try:
        for p in procs:
            p.wait(timeout=120)
    finally:
        for p in procs:
            if p.returncode is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    outputs = [log.read_text() for log in logs]
    results = []
    for text in outputs:
        lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
        assert lines, text
        results.append(json.loads(lines[0][len("RESULT ") :]))
    r0, r1 = results
    assert "raised" not in r0 and "raised" not in r1, results
    assert r0["problems"] == r1["problems"] == ['rank 1: KeyError("a bug in rank 1\'s share")'], results
    assert r0["unexpected"] and r1["unexpected"]
    assert r0.get("discarded") and not r0.get("committed")  # rank 0 cleaned up, committed nothing
    assert "KeyError" in r1["error"] and r0["error"] == "None"
    assert r0["elapsed"] < 15, results  # not the 30 s collective timeout


# ---- a bad argument leaks no process group ------------------------------------------------------------

_ARGS_WORKER = """
import json, signal, sys, threading
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import safepoint

store, tmp = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
groups = lambda: len(c10d._world.pg_map)
before = (groups(), threading.active_count())
local = {"root": tmp + "/durable", "local_root": tmp + "/local"}
cases = {
    "save_every_steps": dict(root=tmp + "/a", save_every_steps=0),
    "save_every_seconds": dict(root=tmp + "/a", save_every_seconds=-1),
    # (a callable: the option object itself refuses the value, inside the try below)
    "collective_timeout": lambda: dict(root=tmp + "/a", save_every_seconds="auto", cluster=safepoint.ClusterOptions(collective_timeout_s=-5)),
    "auto_needs_local_root": dict(root="memory://run", save_every_seconds="auto"),
    "grace_seconds": lambda: dict(root=tmp + "/a", preemption=safepoint.PreemptionOptions(file=tmp + "/p", grace_seconds=-1)),
    "exit_code": lambda: dict(root=tmp + "/a", preemption=safepoint.PreemptionOptions(signals=(signal.SIGUSR1,), grace_seconds=-0.0)),
    "keep_local_last": lambda: dict(local, keep=safepoint.Keep(local_last=0), async_save=True),
    "signal": lambda: dict(root=tmp + "/a", preemption=safepoint.PreemptionOptions(signals=(signal.SIGKILL,)), async_save=True),
    "resume": dict(root=tmp + "/a", resume="sometimes", async_save=True),
}
out = {}
for name, kw in cases.items():
    try:
        safepoint.CheckpointManager(**(kw() if callable(kw) else kw)).close()
        out[name] = "accepted"
    except ValueError as e:
        out[name] = "ValueError"
out["leaked"] = [groups() - before[0], threading.active_count() - before[1]]
with safepoint.CheckpointManager(async_save=True, **local) as mgr:  # a good one still works
    out["while_open"] = groups() - before[0]
out["after_close"] = groups() - before[0]
print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def test_a_bad_argument_raises_before_any_process_group_is_created(tmp_path: Path) -> None:
    proc = run_job(["-c", _ARGS_WORKER, str(tmp_path / "store"), str(tmp_path)], timeout=180)  # forked
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    out = json.loads(lines[0][len("RESULT ") :])
    for name in ("save_every_steps", "save_every_seconds", "collective_timeout", "auto_needs_local_root"):
        assert out[name] == "ValueError", out
    for name in ("grace_seconds", "exit_code", "keep_local_last", "signal", "resume"):
        assert out[name] == "ValueError", out
    assert out["leaked"] == [0, 0], out
    assert out["while_open"] == 3 and out["after_close"] == 0, out  # manager, writer, uploader groups


# ---- the log says what happened -----------------------------------------------------------------------


def test_a_failed_fastest_tier_save_is_not_logged_as_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    preemption = Preemption.build(
        Comm(), safepoint.PreemptionOptions(file=tmp_path / "preempt", grace_seconds=10.0)
    )
    assert preemption is not None
    estimates = (TierEstimate("local", 0.1), TierEstimate("durable", 20.0))
    plan = EmergencyPlan("fastest-tier", ("local",), ("durable",), 0.1, 5.0, estimates)
    with caplog.at_level(logging.INFO, logger="safepoint"):
        e = preemption.exit(7, None, 5, plan)  # the local save failed
    assert e.saved_step is None and e.resume_step == 5
    assert "wrote local only" not in caplog.text
    [error] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "emergency save of step 7 (planned for local only, skipping durable) failed" in error.message
    assert "A restart resumes from step 5" in error.message
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="safepoint"):
        preemption.exit(7, 7, 7, plan)
    assert "emergency save of step 7 wrote local only; skipped durable" in caplog.text
