"""Preemption: real signals, a real sentinel file, a real background poller, real torchrun.

Distributed cases run in two torchrun launches (tests/dist_preempt/worker.py), each worker a real process
that the test signals with os.kill:

    launch A (2 ranks): SIGTERM to both workers mid-training, no periodic save due
        -> emergency checkpoint at the current step, Preempted (exit 143), torchrun exits non-zero
    launch B (2 ranks, --max-restarts=4):
        term-resume   resumes launch A's checkpoint at exactly its step; equals an uninterrupted run
        kills         three SIGKILLs at random steps (attempts 0, 1, 2); equals an uninterrupted run
        vanish        attempt 3: rank 1 dies inside the preemption collectives; rank 0 fails fast
        one           SIGUSR1 to rank 1 only: both ranks save the same step, then exit (no restarts left)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml  # type: ignore[import-untyped]

import safepoint
from safepoint.preempt.preemption import DEFAULT_EXIT_CODE, TierEstimate, plan_emergency_save
from safepoint.store.posix_layout import Layout
from tests.conftest import REPO
from tests.helpers.example_runs import PipedJob
from tests.helpers.launch import assert_bitwise, events, finish, load, ready_pids, start
from tests.helpers.s3 import free_port
from tests.helpers.train import Setup

WORKER = REPO / "tests" / "dist_preempt" / "worker.py"
EXAMPLE = REPO / "examples" / "preemptible_train.py"


def manifest(root: Path, step: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((root / f"step-{step}" / "safepoint.json").read_text())
    return data


def committed(root: Path) -> list[int]:
    return Layout(root).committed_steps()


def train_until_preempted(
    mgr: safepoint.CheckpointManager, s: Setup, *, start: int = 0, at: int | None = None, sleep: float = 0.0
) -> safepoint.Preempted:
    """Train, calling maybe_save each step; SIGTERM ourselves after step ``at``; return the Preempted."""
    step = start
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s.step()
        step += 1
        if step == at:
            os.kill(os.getpid(), signal.SIGTERM)
        if sleep:
            time.sleep(sleep)
        try:
            mgr.maybe_save(step, s.state())
        except safepoint.Preempted as e:
            return e
    raise AssertionError("never preempted")


# ---- single process ----------------------------------------------------------------------------------


def test_sigterm_saves_the_current_step_and_raises_preempted(root: Path) -> None:
    s = Setup()
    mgr = safepoint.CheckpointManager(
        root,
        save_every_steps=100,
        preemption=safepoint.PreemptionOptions(signals=(signal.SIGTERM,), exit_code=77),
    )
    e = train_until_preempted(mgr, s, at=7)
    assert isinstance(e, SystemExit) and e.code == 77
    assert (e.step, e.saved_step, e.resume_step, e.reason) == (7, 7, 7, "SIGTERM")
    assert committed(root) == [7]  # no periodic save was due: this is the emergency save
    m = manifest(root, 7)
    assert m["extra"]["emergency"] == {"reason": "SIGTERM", "plan": "full"}
    assert "capture_s" in m["extra"]["timings"]  # synchronous
    expected = s.snapshot()
    mgr.close()
    again = Setup(seed=5)
    with safepoint.CheckpointManager(root) as mgr2:
        assert mgr2.restore(again.state()) == 7
    assert all(torch.equal(expected[k], v) for k, v in again.snapshot().items())


def test_default_exit_code_is_143_and_no_handlers_by_default(root: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with safepoint.CheckpointManager(root, save_every_steps=5):
        assert signal.getsignal(signal.SIGTERM) is before  # opt-in only
    e = safepoint.Preempted(DEFAULT_EXIT_CODE, step=1, saved_step=1, resume_step=1, reason="x")
    assert e.code == 143 and isinstance(e, SystemExit) and not isinstance(e, Exception)
    with pytest.raises(ValueError, match="exit_code"):
        safepoint.PreemptionOptions(exit_code=0)


def test_previous_handler_is_chained_and_restored_on_close(root: Path) -> None:
    calls: list[int] = []

    def previous(signum: int, frame: object) -> None:
        calls.append(signum)

    signal.signal(signal.SIGTERM, previous)
    mgr = safepoint.CheckpointManager(
        root, preemption=safepoint.PreemptionOptions(signals=(signal.SIGTERM, signal.SIGUSR1))
    )
    assert signal.getsignal(signal.SIGTERM) is not previous
    e = train_until_preempted(mgr, Setup(), at=3)
    assert calls == [signal.SIGTERM]  # the flag was set and the previous handler still ran
    assert e.saved_step == 3
    mgr.close()
    assert signal.getsignal(signal.SIGTERM) is previous
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_signal_handlers_need_the_main_thread(root: Path) -> None:
    errors: list[BaseException] = []

    def make() -> None:
        try:
            safepoint.CheckpointManager(
                root, preemption=safepoint.PreemptionOptions(signals=(signal.SIGTERM,))
            )
        except ValueError as e:
            errors.append(e)

    t = threading.Thread(target=make)
    t.start()
    t.join()
    assert (
        len(errors) == 1
        and "main thread" in str(errors[0])
        and "PreemptionOptions(file=...)" in str(errors[0])
    )
    # Nothing was left behind: the root is not leased, a manager in the main thread opens it.
    with safepoint.CheckpointManager(root, preemption=safepoint.PreemptionOptions(signals=(signal.SIGTERM,))):
        pass


def test_sentinel_file_notice(root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    flag = tmp_path / "preempt"
    flag.write_text("left by an earlier attempt")
    s = Setup()
    with caplog.at_level(logging.WARNING, logger="safepoint"):
        mgr = safepoint.CheckpointManager(root, preemption=safepoint.PreemptionOptions(file=flag))
    assert not flag.exists() and "stale preemption file" in caplog.text
    for step in range(1, 4):
        s.step()
        assert not mgr.maybe_save(step, s.state())  # no notice, no save policy: nothing
    flag.touch()
    e = train_until_preempted(mgr, s, start=3, sleep=0.01)
    assert e.reason == f"file {flag}" and e.saved_step == e.step >= 4
    assert committed(root) == [e.step]
    mgr.close()


def test_polled_callable_notice_and_its_failures_are_logged(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    polls: list[float] = []

    def metadata_says_preempted() -> bool:
        polls.append(time.monotonic())
        if len(polls) == 1:
            raise ConnectionError("metadata endpoint unreachable")
        return len(polls) >= 3

    with caplog.at_level(logging.WARNING, logger="safepoint"):
        mgr = safepoint.CheckpointManager(
            root, preemption=safepoint.PreemptionOptions(poll=metadata_says_preempted, poll_interval_s=0.02)
        )
        e = train_until_preempted(mgr, Setup(), sleep=0.01)
        mgr.close()
    assert (
        e.reason
        == "poll test_polled_callable_notice_and_its_failures_are_logged.<locals>.metadata_says_preempted"
    )
    assert len(polls) == 3 and "metadata endpoint unreachable" in caplog.text
    assert committed(root) == [e.step]


def test_grace_too_short_skips_the_save_and_logs_the_fallback(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = Setup()
    mgr = safepoint.CheckpointManager(
        root,
        save_every_steps=5,
        preemption=safepoint.PreemptionOptions(signals=(signal.SIGTERM,), grace_seconds=0.001),
    )
    with caplog.at_level(logging.INFO, logger="safepoint"):
        e = train_until_preempted(mgr, s, at=7)
    mgr.close()
    # Step 5's save was measured (its manifest records how long it took); a save of step 7 cannot finish in
    # 1 ms, so it is not started: the restart resumes at step 5.
    assert (e.step, e.saved_step, e.resume_step, e.code) == (7, None, 5, 143)
    assert committed(root) == [5] and not (root / "step-7").exists()
    skipped = [r for r in caplog.records if r.levelno == logging.ERROR and "NOT saving step 7" in r.message]
    assert len(skipped) == 1, caplog.text
    assert (
        "previous checkpoint (step 5)" in skipped[0].message
        and "steps 6-7 will be redone" in skipped[0].message
    )
    assert "skipped tier(s): root" in skipped[0].message
    # With enough grace the same situation saves.
    mgr2 = safepoint.CheckpointManager(
        root, preemption=safepoint.PreemptionOptions(signals=(signal.SIGTERM,), grace_seconds=60)
    )
    e2 = train_until_preempted(mgr2, s, start=5, at=7)
    mgr2.close()
    assert e2.saved_step == 7 and committed(root) == [5, 7]


def test_no_measured_history_still_saves(root: Path) -> None:
    mgr = safepoint.CheckpointManager(
        root, preemption=safepoint.PreemptionOptions(signals=(signal.SIGTERM,), grace_seconds=0.001)
    )
    e = train_until_preempted(mgr, Setup(), at=2)
    mgr.close()
    # Nothing says the save will not fit: refusing would lose the work for sure.
    assert e.saved_step == 2 and manifest(root, 2)["extra"]["emergency"]["plan"] == "full"


def test_async_save_in_flight_is_finished_before_the_emergency_save(root: Path) -> None:
    s = Setup()
    mgr = safepoint.CheckpointManager(
        root,
        save_every_steps=5,
        async_save=True,
        preemption=safepoint.PreemptionOptions(signals=(signal.SIGTERM,)),
    )
    e = train_until_preempted(mgr, s, at=6)
    # Before close(): the save of step 5 had committed before step 6 was written, synchronously.
    assert e.saved_step == 6 and committed(root) == [5, 6]
    m5, m6 = manifest(root, 5), manifest(root, 6)
    assert "stage_s" in m5["extra"]["timings"] and "capture_s" in m6["extra"]["timings"]
    started_6 = m6["time"] - m6["extra"]["timings"]["capture_s"] - m6["extra"]["timings"]["write_s"]
    assert m5["time"] <= started_6 + 0.005
    mgr.close()


def test_already_committed_step_is_not_saved_again(root: Path) -> None:
    s = Setup()
    mgr = safepoint.CheckpointManager(
        root, save_every_steps=5, preemption=safepoint.PreemptionOptions(signals=(signal.SIGTERM,))
    )
    for step in range(1, 6):
        s.step()
        mgr.maybe_save(step, s.state())
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(safepoint.Preempted) as info:
        mgr.maybe_save(5, s.state())  # called again for the step just saved
    assert info.value.saved_step == 5 and [r.step for r in mgr.saves] == [5]
    assert "emergency" not in manifest(root, 5)["extra"]
    mgr.close()


def test_emergency_plan_hook() -> None:
    one = [TierEstimate("root", 10.0)]
    assert plan_emergency_save(one, None).action == "full"
    assert plan_emergency_save(one, 12.0).action == "full"
    skip = plan_emergency_save(one, 9.0)
    assert (skip.action, skip.tiers, skip.skipped, skip.saves) == ("skip", (), ("root",), False)
    assert plan_emergency_save([TierEstimate("root", None)], 0.1).action == "full"
    two = [TierEstimate("local", 4.0), TierEstimate("durable", 30.0)]
    assert plan_emergency_save(two, 40.0).tiers == ("local", "durable")
    fast = plan_emergency_save(two, 10.0)
    assert (fast.action, fast.tiers, fast.skipped) == ("fastest-tier", ("local",), ("durable",))
    assert plan_emergency_save(two, 3.0).action == "skip"


# ---- the example script, the Slurm and Kubernetes files ---------------------------------------------------


def _example(root: Path, *args: str) -> PipedJob:
    """``python examples/preemptible_train.py --root ROOT ARGS``, its stdout and stderr captured, forked
    from the suite's fork server (~4.5 s of CPU less per run; the Slurm test below runs the script fresh,
    as a user does)."""
    return PipedJob([str(EXAMPLE), "--root", str(root), *args], stderr=None)


def test_example_runs_gets_preempted_and_resumes(root: Path) -> None:
    first = _example(root, "--steps", "100000", "--step-sleep", "0.005", "--grace-seconds", "30")
    assert first.stdout is not None
    assert first.stdout.readline().strip() == "[rank 0] resumed at step 0"  # handlers are installed now
    time.sleep(0.3)
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=60)
    assert first.returncode == 143, err[-3000:]
    [step] = committed(root)
    assert f"preempted at step {step} (SIGTERM); saved step {step}" in err
    again = _example(root, "--steps", str(step + 3))
    out, err = again.communicate(timeout=60)
    assert again.returncode == 0, err[-3000:]
    assert out.splitlines() == [
        f"[rank 0] resumed at step {step}",
        f"[rank 0] finished at step {step + 3}, samples_seen={16 * (step + 3)}",
    ]


def test_kubernetes_job_parses_and_matches_the_script() -> None:
    docs = list(yaml.safe_load_all((REPO / "examples" / "kubernetes" / "job.yaml").read_text()))
    job = next(d for d in docs if d["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] >= 1
    assert job["spec"]["podFailurePolicy"]["rules"][0]["onPodConditions"] == [{"type": "DisruptionTarget"}]
    [container] = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    hook = " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    assert f"touch {env['SAFEPOINT_PREEMPT_FILE']}" in hook
    # The save must fit in the grace period, which also covers the preStop hook.
    assert float(env["SAFEPOINT_GRACE_SECONDS"]) < pod["terminationGracePeriodSeconds"]
    assert "examples/preemptible_train.py" in " ".join(container["command"] + container.get("args", []))


FAKE_SRUN = """#!/bin/bash
# Stands in for srun on a machine without Slurm: drops srun's options and becomes the task. Real srun
# forwards the signals it receives to its tasks; exec gives the same delivery to this single task.
while [[ "$1" == --* ]]; do shift; done
exec "$@"
"""
FAKE_SCONTROL = """#!/bin/bash
case "$1" in
    show) echo localhost ;;
    requeue) echo "$2" >> "$SCONTROL_LOG" ;;
esac
"""


def test_slurm_script_forwards_the_signal_then_requeues(tmp_path: Path, root: Path) -> None:
    script = REPO / "examples" / "slurm" / "train.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "#SBATCH --signal=B:USR1@120" in text and "#SBATCH --requeue" in text
    # Run it for real under bash with torchrun; only srun and scontrol are stand-ins (no Slurm here).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    requeued = tmp_path / "requeued"
    env = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        PYTHONPATH=str(REPO / "src"),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="t",
        SLURM_NNODES="1",
        SLURM_JOB_NODELIST="localhost",
        SCONTROL_LOG=str(requeued),
        SAFEPOINT_ROOT=str(root),
        SAFEPOINT_STEP_SLEEP="0.01",
        GPUS="1",
        GRACE="30",
        RDZV_PORT=str(free_port()),
    )
    out = tmp_path / "slurm.out"
    with open(out, "w") as f:
        batch = subprocess.Popen(["bash", str(script)], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while "resumed at step 0" not in out.read_text():
        assert batch.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
        time.sleep(0.05)
    batch.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 delivers: to the batch shell only
    status = batch.wait(timeout=120)
    log = out.read_text()
    assert "batch shell got SIGUSR1" in log and status != 0, log[-3000:]
    [step] = committed(root)
    m = manifest(root, step)
    assert m["extra"]["emergency"]["reason"] == "SIGUSR1"
    # Requeued once, and only after the job step had committed its save and exited.
    assert requeued.read_text() == "4242\n" and requeued.stat().st_mtime >= m["time"]


# ---- torchrun -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Launch:
    rc: int
    log: str


@dataclasses.dataclass
class DistRuns:
    out: Path
    a: Launch
    b: Launch
    term_step: int
    kills: list[dict[str, int]]

    def events(self, job: str, event: str) -> list[dict[str, Any]]:
        return events(self.out, job, event)


def _finish(out: Path, tag: str, proc: subprocess.Popen[str]) -> Launch:
    return Launch(*finish(out, tag, proc))


def _job(name: str, root: Path, steps: int, **kw: Any) -> dict[str, Any]:
    return {"name": name, "root": str(root), "steps": steps, **kw}


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory: pytest.TempPathFactory) -> DistRuns:
    out = tmp_path_factory.mktemp("preempt2")
    # A: both workers get SIGTERM mid-training; no periodic saves.
    a = start(WORKER, out, "a", [_job("term", out / "term", 100_000, preempt=True, ready_after=3)])
    for pid in ready_pids(out, "term", a):
        os.kill(pid, signal.SIGTERM)
    launch_a = _finish(out, "a", a)
    steps = {e["step"] for e in events(out, "term", "preempted")}
    assert len(steps) == 1, f"ranks stopped at different steps: {steps}\n{launch_a.log[-4000:]}"
    term_step = steps.pop()

    # B: resume A; three SIGKILLs at random steps under --max-restarts=3; one rank signalled.
    rng = random.Random(6)
    kill_steps = sorted(rng.sample(range(2, 24), 3))
    kills = [{"attempt": i, "rank": rng.randrange(2), "step": k} for i, k in enumerate(kill_steps)]
    jobs = [
        _job("term-resume", out / "term", term_step + 3),
        _job("term-ref", out / "term-ref", term_step + 3),
        _job("ref", out / "ref", 24, save_every=3),
        _job("kills", out / "kills", 24, save_every=3, kills=kills),
        _job("vanish", out / "vanish", 40, save_every=3, preempt=True, vanish={"attempt": 3, "step": 7}),
        _job("one", out / "one", 100_000, preempt=True, ready_after=3),
    ]
    b = start(WORKER, out, "b", jobs, max_restarts=4)
    pids = ready_pids(out, "one", b)
    os.kill(pids[1], signal.SIGUSR1)  # rank 1 only
    launch_b = _finish(out, "b", b)
    return DistRuns(out, launch_a, launch_b, term_step, kills)


def _final(out: Path, name: str) -> dict[str, Any]:
    return load(out / f"{name}.final.pt")


@pytest.mark.slow  # make test budget: torchrun kills and SIGTERMs also run by default in tests/dist and test_preemption_loader
@pytest.mark.timeout(600)
def test_torchrun_sigterm_to_both_ranks_saves_current_step_and_resumes_exactly(dist_runs: DistRuns) -> None:
    r, step = dist_runs, dist_runs.term_step
    assert r.a.rc != 0 and "exitcode  : 143" in r.a.log, r.a.log[-4000:]
    pre = r.events("term", "preempted")
    assert sorted(e["rank"] for e in pre) == [0, 1]
    assert all(e["saved"] == step and e["code"] == 143 for e in pre), pre
    # Both ranks got the signal themselves; the checkpoint is the emergency save (no periodic saves).
    assert committed(r.out / "term") == [step] and step >= 3
    reason = manifest(r.out / "term", step)["extra"]["emergency"]["reason"]
    assert reason == "SIGTERM on rank 0; SIGTERM on rank 1"
    resumed = r.events("term-resume", "restored")
    assert [(e["rank"], e["step"], e["attempt"]) for e in sorted(resumed, key=lambda e: e["rank"])] == [
        (0, step, 0),
        (1, step, 0),
    ]
    assert_bitwise(_final(r.out, "term-resume"), _final(r.out, "term-ref"), "term-resume")


@pytest.mark.slow  # make test budget: torchrun kills and SIGTERMs also run by default in tests/dist and test_preemption_loader
@pytest.mark.timeout(600)
def test_torchrun_signal_to_one_rank_saves_the_same_step_on_all(dist_runs: DistRuns) -> None:
    r = dist_runs
    assert r.b.rc != 0, r.b.log[-4000:]
    pre = r.events("one", "preempted")
    assert sorted(e["rank"] for e in pre) == [0, 1], r.b.log[-4000:]
    [step] = {e["step"] for e in pre}
    assert all(e["saved"] == step and e["reason"] == "SIGUSR1 on rank 1" for e in pre), pre
    assert committed(r.out / "one") == [step]


@pytest.mark.slow  # make test budget: torchrun kills and SIGTERMs also run by default in tests/dist and test_preemption_loader
@pytest.mark.timeout(600)
def test_torchrun_three_sigkills_with_max_restarts_match_an_uninterrupted_run(dist_runs: DistRuns) -> None:
    r = dist_runs
    killed = sorted(r.events("kills", "killing"), key=lambda e: e["attempt"])
    assert [(e["attempt"], e["rank"], e["step"]) for e in killed] == [
        (k["attempt"], k["rank"], k["step"]) for k in r.kills
    ], r.b.log[-4000:]
    restored = [e for e in r.events("kills", "restored") if e["rank"] == 0]
    # Each attempt resumes from the newest checkpoint before the previous attempt's kill.
    expected = [0] + [3 * ((k["step"] - 1) // 3) for k in r.kills]
    assert [(e["attempt"], e["step"]) for e in restored] == list(enumerate(expected))
    assert_bitwise(_final(r.out, "kills"), _final(r.out, "ref"), "kills")


@pytest.mark.slow  # make test budget: torchrun kills and SIGTERMs also run by default in tests/dist and test_preemption_loader
@pytest.mark.timeout(600)
def test_torchrun_peer_vanishing_in_the_emergency_collectives_fails_fast(dist_runs: DistRuns) -> None:
    r = dist_runs
    [failed] = [e for e in r.events("vanish", "collective_failed") if e["attempt"] == 3]
    assert failed["rank"] == 0 and failed["error"] == "PeerTimeoutError", failed
    assert "a rank died" in failed["msg"] and "restart the job" in failed["msg"]
    # Long before collective_timeout_s (30 s): the dead peer's connection closed, gloo noticed at once.
    assert failed["since"] < 10, failed
    assert not (r.out / "vanish" / f"step-{failed['step']}").exists() or failed["step"] % 3 == 0
    # The next attempt resumed from the last periodic checkpoint and finished the job.
    assert [e["step"] for e in r.events("vanish", "finished")] == [40, 40]
