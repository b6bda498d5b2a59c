"""A restart never waits on its own lease (issue 15, item 1): the lease records the job, a restart of the
same job takes it over at once on any host, another job stays refused, and the old holder is fenced out.
Real processes, each on its own host (a UTS namespace of its own); the staleness limit is an hour, so only the job
rule can let anyone in."""

from __future__ import annotations

import json
import logging
import os
import signal
import textwrap
import time
from pathlib import Path

import pytest

import safepoint
from safepoint.store.job import job_identity
from tests.helpers.example_runs import PipedJob
from tests.store.test_fencing import _unshare_works

# Takes the root as `who` (or says it was refused), saves the steps `now`, then, once a line arrives on
# stdin, tries to save the steps `later`; says what happened, and holds the lease until stdin closes.
HOLDER = textwrap.dedent(
    """
    import socket, sys, safepoint
    root, who, job, now, later = sys.argv[1:6]
    cluster = safepoint.ClusterOptions(lease_stale_after_s=3600, job_id=None if job == "-" else job)
    try:
        mgr = safepoint.CheckpointManager(root, cluster=cluster)
    except safepoint.LeaseError as e:
        print(f"{who}: refused: {e}", flush=True)
        sys.exit(0)
    print(f"{who}: holds the root on {socket.gethostname()}", flush=True)

    def save(steps):
        for step in [int(s) for s in steps.split(",") if s]:
            try:
                mgr.save(step, safepoint.TrainState(rng=False, extra={"who": who}))
            except safepoint.CheckpointError as e:  # the fence's LeaseError, inside a SaveError
                print(f"{who}: not committed: {e}", flush=True)
                return
            print(f"{who}: committed {step}", flush=True)

    save(now)
    if later:
        sys.stdin.readline()
        save(later)
    sys.stdin.read()
    try:
        mgr.close()
    except safepoint.CheckpointError:
        pass
    """
)

pytestmark = pytest.mark.skipif(
    not _unshare_works(), reason="needs `unshare --uts` (root, Linux) to run each holder as its own host"
)


def _on_host(
    host: str, root: Path, who: str, job: str, env: dict[str, str], now: str, later: str = ""
) -> PipedJob:
    """The holder as its own host (a UTS namespace named ``host``, as ``unshare --uts`` and ``hostname``
    give), forked from the suite's fork server: a fresh interpreter is not the subject (~4.5 s of CPU each)."""
    return PipedJob(
        ["-c", HOLDER, str(root), who, job, now, later], extra_env=env, per_run=_RUN_ID, hostname=host
    )


_RUN_ID = ("TORCHELASTIC_RUN_ID",)  # read when a manager names its job, never at import


def _line(proc: PipedJob) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, f"process {proc.pid} ended without answering (rc={proc.wait()})"
    return line


def _finish(proc: PipedJob) -> None:
    proc.communicate(timeout=120)


# The explicit id with a SIGKILLed holder runs under -m slow; the default run keeps torchrun's run id with
# a frozen (SIGSTOPped) holder, which also proves the stale holder is fenced when it wakes.
@pytest.mark.parametrize(
    ("source", "death"),
    [pytest.param("job_id", "SIGKILL", marks=pytest.mark.slow), ("torchrun", "SIGSTOP")],
)
def test_a_restart_of_the_same_job_on_another_host_takes_the_lease_at_once(
    root: Path, source: str, death: str
) -> None:
    def job(name: str) -> tuple[str, dict[str, str]]:
        """(the job_id argument, the environment) naming job ``name`` the way ``source`` does."""
        if source == "job_id":
            return name, {}
        return "-", {"TORCHELASTIC_RUN_ID": name}  # what torchrun --rdzv-id=NAME sets

    a = _on_host("nodeA", root, "A", *job("run-a"), now="1", later="2")
    b = c = None
    try:
        assert _line(a) == "A: holds the root on nodeA"
        assert _line(a) == "A: committed 1"
        a.send_signal(getattr(signal, death))  # A's node dies (or freezes) holding the lease
        c = _on_host("nodeC", root, "C", *job("run-other"), now="")
        refused = _line(c)
        assert refused.startswith("C: refused: checkpoint root") and "on host 'nodeA'" in refused, refused
        c.communicate(timeout=120)
        b = _on_host("nodeB", root, "B", *job("run-a"), now="2,3")
        assert _line(b) == "B: holds the root on nodeB"
        assert _line(b) == "B: committed 2"
        assert _line(b) == "B: committed 3"
        if death == "SIGSTOP":
            # The old holder wakes up and tries to save step 2: fenced out, B's step 2 stays.
            assert a.stdin is not None
            a.stdin.write("go\n")
            a.stdin.flush()
            a.send_signal(signal.SIGCONT)
            line = _line(a)
            assert line.startswith("A: not committed:") and "nodeB" in line, line
        lease = json.loads((root / ".lease").read_text())
        assert lease["host"] == "nodeB"
        assert lease["job"] == ("job:run-a" if source == "job_id" else "torchrun:run-a")
    finally:
        for p in (a, b, c):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.communicate("", timeout=120) if p is b else p.kill()
                p.wait()
    with safepoint.CheckpointManager(root, resume="required") as mgr:
        for step, who in ((1, "A"), (2, "B"), (3, "B")):
            state = safepoint.TrainState(rng=False, extra={"who": None})
            assert mgr.restore(state, step=step) == step
            assert state.extra == {"who": who}


def test_job_identity_names_the_job_or_nothing() -> None:
    assert job_identity("exp-42", {}) == "job:exp-42"
    assert job_identity(None, {"SAFEPOINT_JOB_ID": "exp-42", "SLURM_JOB_ID": "7"}) == "job:exp-42"
    slurm = {"SLURM_JOB_ID": "1", "SLURM_CLUSTER_NAME": "c1", "TORCHELASTIC_RUN_ID": "r"}
    assert job_identity(None, slurm) == "slurm:c1/1"  # a requeue keeps it; torchrun's id may not
    assert job_identity(None, {"TORCHELASTIC_RUN_ID": "exp-42"}) == "torchrun:exp-42"
    assert job_identity(None, {"TORCHELASTIC_RUN_ID": "none"}) is None  # torchrun's default: not an id
    assert job_identity(None, {}) is None


@pytest.mark.parametrize("bad", ["none", "Default", "", " x", "a\nb", "x" * 300, 7])
def test_ids_that_do_not_name_one_job_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="ClusterOptions.job_id"):
        safepoint.ClusterOptions(job_id=bad)  # type: ignore[arg-type]


def test_a_shared_job_id_in_the_environment_is_refused_before_any_group(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SAFEPOINT_JOB_ID", "none")
    with pytest.raises(ValueError, match="SAFEPOINT_JOB_ID"):
        safepoint.CheckpointManager(root)
    assert not os.path.exists(root / ".lease")


@pytest.mark.parametrize("copied", ["456", "100", "1", "123", "my_job", "$JOB_ID", "none"])
def test_a_run_id_copied_from_the_examples_is_no_identity(
    copied: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two unrelated jobs launched with the tutorial's ``--rdzv-id=456`` must not take each other's root:
    the id is ignored (with a warning naming SAFEPOINT_JOB_ID), so neither job has an identity."""
    with caplog.at_level(logging.WARNING, "safepoint"):
        assert job_identity(None, {"TORCHELASTIC_RUN_ID": copied}) is None
    if copied != "none":  # torchrun's own default says nothing: no warning for it
        assert "SAFEPOINT_JOB_ID" in caplog.text and copied in caplog.text
    assert job_identity(None, {"TORCHELASTIC_RUN_ID": "12345678"}) == "torchrun:12345678"


def test_a_job_with_a_copied_run_id_does_not_take_a_live_holders_root(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder of job 'torchrun:456' on another host, beating: a new job with TORCHELASTIC_RUN_ID=456 used to
    count as its restart and take the root at once."""
    root.mkdir(parents=True)
    rec = {"host": "elsewhere", "pid": 4242, "job": "torchrun:456", "token": "theirs"}
    (root / ".lease").write_text(json.dumps({**rec, "heartbeat": time.time()}))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "456")
    with pytest.raises(safepoint.LeaseError, match="is in use by"):
        safepoint.CheckpointManager(root)
    assert json.loads((root / ".lease").read_text())["token"] == "theirs"
