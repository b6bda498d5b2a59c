"""Emergency saves under tiering (local_root + an S3 root on moto's server, real s3fs over HTTP).

The plan sees both tiers: the local save (timed from the local manifests) and the upload (timed from the
uploads this run and its predecessors measured, ``LOCAL_ROOT/.uploads.json``). Uploads are made slow for
real: the fault proxy holds the first data PUT of a step until the test lets it through, so the measured
upload takes ~SLOW_UPLOAD_S while the local save of the tiny model takes milliseconds. Notices are real
SIGTERMs to this process, as in tests/preempt/test_preemption.py.

The last test does the same with a 2-rank torchrun job (tests/dist_preempt/worker.py, gloo), SIGTERM to one
worker: both ranks must agree on the plan, the emergency step is committed locally with both ranks' shards,
and nothing of it is sent to the store before the job exits; a second launch resumes there and uploads it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import safepoint
from safepoint.policy.history import UPLOADS_NAME, UploadHistory
from safepoint.remote.object_layout import RemoteLayout
from safepoint.store.posix_layout import Layout
from tests.conftest import REPO
from tests.helpers.launch import assert_bitwise, events, finish, load, ready_pids, start, stop
from tests.helpers.s3 import FaultProxy, storage_options, tiered_manager
from tests.helpers.train import Setup, train_until_preempted

SLOW_UPLOAD_S = 1.5  # so one upload is expected to take >= 1.25 x 1.5 = 1.9 s
DIST_WORKER = REPO / "tests" / "dist_preempt" / "worker.py"


def _notices(grace_seconds: float) -> safepoint.PreemptionOptions:
    return safepoint.PreemptionOptions(signals=(signal.SIGTERM,), grace_seconds=grace_seconds)


def _hold_upload_of(proxy: FaultProxy, step: int) -> None:
    proxy.hold(method="PUT", path=rf"/run/step-{step}/__0_0\.distcp", count=1)


def _train_with_a_slow_upload(mgr: safepoint.CheckpointManager, s: Setup, proxy: FaultProxy) -> None:
    """Steps 1-5: step 5 is saved and its upload is held for SLOW_UPLOAD_S, then completes."""
    _hold_upload_of(proxy, 5)
    assert train_until_preempted(mgr, s, range(1, 6)) is None
    assert proxy.held.wait(60), "the upload of step 5 never started"
    time.sleep(SLOW_UPLOAD_S)
    proxy.release.set()
    mgr.wait()
    assert mgr.durability_lag().durable_step == 5


def _preempted_at_7(
    tmp_path: Path, proxy: FaultProxy, bucket: str, grace: float
) -> tuple[safepoint.CheckpointManager, Any]:
    """A save at step 5 with a slow upload, then SIGTERM at step 7: the manager and its Preempted."""
    s = Setup()
    mgr = tiered_manager(tmp_path, proxy, bucket, preemption=_notices(grace))
    _train_with_a_slow_upload(mgr, s, proxy)
    return mgr, train_until_preempted(mgr, s, range(6, 100), term_at=7)


def _requests_for(proxy: FaultProxy, step: int) -> list[tuple[str, str, str]]:
    return [r for r in proxy.seen if f"/run/step-{step}/" in r[1]]


def _durable(proxy: FaultProxy, bucket: str) -> list[int]:
    return RemoteLayout(f"s3://{bucket}/run", storage_options(proxy.endpoint)).committed_steps()


def _emergency(local: Path, step: int) -> dict[str, Any]:
    m = json.loads((local / f"step-{step}" / "safepoint.json").read_text())
    emergency: dict[str, Any] = m["extra"]["emergency"]
    return emergency


def test_grace_too_short_for_the_upload_saves_locally_only(
    tmp_path: Path, proxy: FaultProxy, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="safepoint")
    local = tmp_path / "local"
    mgr, e = _preempted_at_7(tmp_path, proxy, bucket, grace=1.0)
    # The local save (milliseconds) fits in 1 s; local + upload (>= 1.9 s) does not.
    assert (e.step, e.saved_step, e.resume_step) == (7, 7, 7)
    assert _emergency(local, 7) == {"reason": "SIGTERM", "plan": "fastest-tier"}
    lag = mgr.durability_lag()
    assert (lag.durable_step, lag.steps, lag.uploads_pending) == (5, 2, 1)  # step 7 is local-only
    mgr.close()
    assert "emergency save of step 7 wrote local only; skipped durable" in caplog.text
    assert "not uploading step(s) [7]" in caplog.text and "stay on the local tier only" in caplog.text
    assert not _requests_for(proxy, 7), "no upload of the emergency checkpoint was started"
    assert _durable(proxy, bucket) == [5] and Layout(local).committed_steps() == [5, 7]

    # The next run on this node restores the local-only checkpoint and uploads it.
    again = Setup(seed=3)
    with tiered_manager(tmp_path, proxy, bucket) as mgr2:
        assert mgr2.restore(again.state()) == 7
        mgr2.wait()
    assert _durable(proxy, bucket) == [5, 7]


def test_grace_long_enough_saves_and_uploads(
    tmp_path: Path, proxy: FaultProxy, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="safepoint")
    mgr, e = _preempted_at_7(tmp_path, proxy, bucket, grace=60)
    mgr.close()  # what leaving the with block does: waits for the upload
    assert e.saved_step == 7 and _emergency(tmp_path / "local", 7)["plan"] == "full"
    # Both tiers were estimated from measurements, and the full save fit.
    assert re.search(
        r"expected save time local \d+\.\d+s \(1.25x the slowest of the last 3 saves\), durable "
        r"\d+\.\d+s \(1.25x the slowest of the last 3 uploads\): full",
        caplog.text,
    ), caplog.text
    assert _requests_for(proxy, 7) and _durable(proxy, bucket) == [5, 7]


def test_grace_too_short_for_anything_skips_and_starts_nothing(
    tmp_path: Path, proxy: FaultProxy, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    s, local = Setup(), tmp_path / "local"
    mgr = tiered_manager(tmp_path, proxy, bucket, preemption=_notices(0.001))
    assert train_until_preempted(mgr, s, range(1, 6)) is None
    mgr.wait()
    with caplog.at_level(logging.INFO, logger="safepoint"):
        e = train_until_preempted(mgr, s, range(6, 100), term_at=7)
        mgr.close()
    assert (e.step, e.saved_step, e.resume_step) == (7, None, 5)
    [skipped] = [r for r in caplog.records if r.levelno == logging.ERROR and "NOT saving step 7" in r.message]
    assert "even the fastest tier (local)" in skipped.message
    assert "skipped tier(s): local, durable" in skipped.message
    assert Layout(local).committed_steps() == [5] and not _requests_for(proxy, 7)


def test_upload_history_survives_restarts_and_the_backlog_counts_and_waits(
    tmp_path: Path, proxy: FaultProxy, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    s, local = Setup(), tmp_path / "local"
    with tiered_manager(tmp_path, proxy, bucket) as mgr:
        _train_with_a_slow_upload(mgr, s, proxy)
    [recorded] = json.loads((local / UPLOADS_NAME).read_text())["uploads"]
    assert recorded["seconds"] >= SLOW_UPLOAD_S

    # A new run: its first upload (step 10) is held in flight and step 15's is queued behind it when the
    # notice comes at step 16. One upload is expected to take >= 1.9 s (the predecessor's measurement); the
    # emergency upload would queue behind both, so >= 5.6 s: more than the 3 s grace, though one upload
    # alone would fit.
    _hold_upload_of(proxy, 10)
    mgr = tiered_manager(tmp_path, proxy, bucket, preemption=_notices(3.0))
    assert mgr.restore(s.state()) == 5
    caplog.set_level(logging.INFO, logger="safepoint")
    assert train_until_preempted(mgr, s, range(6, 16)) is None
    assert proxy.held.wait(60)
    # Step 10's upload finishes soon after the notice: the uploader is then free, and still must not start
    # step 15's (queued before the notice), which the grace was planned without.
    release = threading.Timer(0.5, proxy.release.set)
    release.start()
    try:
        e = train_until_preempted(mgr, s, range(16, 100), term_at=16)
        assert e.saved_step == 16 and _emergency(local, 16)["plan"] == "fastest-tier"
        mgr.close()
    finally:
        release.cancel()
        proxy.release.set()
    assert "behind 2 upload(s) in flight or queued" in caplog.text
    assert "not uploading step(s) [16], nor the queued step(s) [15]" in caplog.text
    assert "not uploading step 15: the preemption's grace leaves no time to upload it" in caplog.text
    assert not _requests_for(proxy, 15) and not _requests_for(proxy, 16)
    assert _durable(proxy, bucket) == [5, 10]

    # The next run uploads both from the local copies.
    with tiered_manager(tmp_path, proxy, bucket) as mgr3:
        assert mgr3.restore(Setup(seed=1).state()) == 16
        mgr3.wait()
    assert _durable(proxy, bucket) == [5, 10, 15, 16]


def test_upload_history_is_advisory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # An unreadable file means no measurement (the plan then attempts the full save), never an error.
    (tmp_path / UPLOADS_NAME).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="safepoint"):
        history = UploadHistory(tmp_path)
    assert history.expected() is None and f"ignoring unreadable {tmp_path / UPLOADS_NAME}" in caplog.text
    for seconds in (1.0, 4.0, 2.0, 3.0):
        history.record(seconds, persist=True)
    # 1.25 x the slowest of the last 3 (the 1.0 s upload has aged out), as for saves.
    assert UploadHistory(tmp_path).expected() == pytest.approx(1.25 * 4.0)
    history.record(0.5, persist=False)  # ranks other than 0 keep theirs in memory only
    assert history.expected() == pytest.approx(1.25 * 3.0)
    assert UploadHistory(tmp_path).seconds == [1.0, 4.0, 2.0, 3.0]


def test_close_after_a_notice_waits_for_uploads_only_until_the_grace_ends(
    tmp_path: Path, proxy: FaultProxy, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="safepoint")
    s = Setup()
    mgr = tiered_manager(tmp_path, proxy, bucket, preemption=_notices(1.0))
    _hold_upload_of(proxy, 5)
    assert train_until_preempted(mgr, s, range(1, 6)) is None
    assert proxy.held.wait(60)
    # Without the bound, close() would wait for the held upload until this releases it.
    release = threading.Timer(15, proxy.release.set)
    release.start()
    try:
        t0 = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(safepoint.Preempted) as info:
            mgr.maybe_save(5, s.state())  # step 5 is committed already: no plan, nothing saved again
        mgr.close()
        closed_after = time.monotonic() - t0
    finally:
        release.cancel()
        proxy.release.set()
    assert info.value.saved_step == 5 and closed_after < 1.0 + 2.0, closed_after
    assert "the upload of step 5 is still running: abandoned" in caplog.text
    assert _durable(proxy, bucket) == []


# ---- a 2-rank torchrun job ------------------------------------------------------------------------------

DIST_SLOW_UPLOAD_S = 2.0
DIST_GRACE_S = 2.4
"""Shorter than any full save (the upload alone is expected to take >= 1.25 x DIST_SLOW_UPLOAD_S = 2.5 s),
longer than the local save of the tiny model (1.25 x a save measured in milliseconds) plus the time the
ranks take to act on the notice (~0.25 s, 0.4 s seen on a loaded 2-core machine): both ranks must plan
fastest-tier, with ~2 s to spare for a slow machine."""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_sigterm_to_one_rank_with_grace_too_short_for_the_upload(
    tmp_path: Path, proxy: FaultProxy, bucket: str
) -> None:
    """Both ranks plan fastest-tier, commit the emergency step locally, start no upload, exit 143; the next
    launch resumes at exactly that step from the local tier and uploads it."""
    out, local, url = tmp_path / "out", tmp_path / "local", f"s3://{bucket}/run"
    tiered = {"root": url, "local_root": str(local), "storage_options": storage_options(proxy.endpoint)}
    # Step 5 is saved (its local save timed in its manifest) and its upload is held DIST_SLOW_UPLOAD_S, which
    # both ranks measure (the upload is a collective); the ranks are ready once it is durable.
    _hold_upload_of(proxy, 5)
    job = {"name": "tiered", "steps": 100_000, "save_at": [5], "preempt": True, "ready_after": 6}
    a = start(DIST_WORKER, out, "a", [{**job, **tiered, "grace_seconds": DIST_GRACE_S}])
    try:
        deadline = time.monotonic() + 240
        while not proxy.held.wait(0.1):
            assert a.poll() is None and time.monotonic() < deadline, (out / "a.log").read_text()[-4000:]
        time.sleep(DIST_SLOW_UPLOAD_S)
        proxy.release.set()
        pids = ready_pids(out, "tiered", a)
        os.kill(pids[1], signal.SIGTERM)  # rank 1 only: rank 0 learns of it through the agreement
        rc, output = finish(out, "a", a)
    finally:
        stop(a)
    requests_before_exit = list(proxy.seen)

    pre = events(out, "tiered", "preempted")
    assert sorted(e["rank"] for e in pre) == [0, 1], output[-4000:]
    [step] = {e["step"] for e in pre}
    assert rc != 0 and "exitcode  : 143" in output, output[-4000:]
    for e in pre:  # saved locally, not durable: counted as waiting for an upload that was not started
        assert (e["saved"], e["code"], e["reason"]) == (step, 143, "SIGTERM on rank 1"), e
        assert (e["durable"], e["pending"]) == (5, 1), e
    for rank in (0, 1):  # every rank planned fastest-tier, from both tiers' measured estimates
        text = (out / f"tiered.rank{rank}.log").read_text()
        assert re.search(
            rf"acted on at step {step}, .*expected save time local \d+\.\d+s \(1.25x the slowest of the "
            r"last 3 saves\), durable \d+\.\d+s \(1.25x the slowest of the last 3 uploads\): fastest-tier",
            text,
        ), text
        assert f"emergency save of step {step} wrote local only; skipped durable" in text, text
        assert f"not uploading step(s) [{step}]" in text, text
    # Committed on the local tier with both ranks' shards; nothing of it reached the store before the exit.
    assert Layout(local).committed_steps() == [5, step] and step >= 6
    manifest = Layout(local).read_manifest(step)
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(manifest.files) and manifest.world_size == 2
    assert _emergency(local, step) == {"reason": "SIGTERM on rank 1", "plan": "fastest-tier"}
    assert not [r for r in requests_before_exit if f"/run/step-{step}/" in r[1]], "the upload was started"
    assert _durable(proxy, bucket) == [5]

    # A new launch on this node resumes at exactly that step, from the local tier, and uploads it.
    b = start(DIST_WORKER, out, "b", [{"name": "resume", "steps": step, "dump_restored": True, **tiered}])
    rc, output = finish(out, "b", b)
    assert rc == 0, output[-4000:]
    restored = events(out, "resume", "restored")
    assert [(e["rank"], e["step"], e["committed"]) for e in restored] == [
        (r, step, [5, step]) for r in (0, 1)
    ]
    assert_bitwise(load(out / "resume.restored.pt"), load(out / "tiered.preempted.pt"), "restored")
    assert [m for m, p, _ in proxy.seen if m == "PUT" and f"/run/step-{step}/__1_0.distcp" in p]
    assert _durable(proxy, bucket) == [5, step]
