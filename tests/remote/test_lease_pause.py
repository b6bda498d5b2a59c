"""A holder frozen (SIGSTOP, a real signal: every thread stops, the heartbeat too) past its lease's expiry
on an object store, inside a save or inside retention's delete, while another host takes the root over
and commits; then resumed (SIGCONT). It must neither commit nor delete anything, must fail with one line
naming the new holder, and the new holder's checkpoints (and the old ones it kept) stay byte for byte.

Job A (the holder, this host) announces itself on a pipe at the point under test and waits there; the
test freezes it, job B (hostname ``nodeB``, its own UTS namespace) waits for A's lease to go stale on the
store's clock, takes it over, restores and saves two steps; the test snapshots every object, resumes A,
and compares. Sequenced by pipes; the only wait is the lease aging, which is the behaviour under test.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import textwrap

import pytest

import safepoint
from tests.helpers.example_runs import PipedJob
from tests.helpers.stores import Store
from tests.store.test_fencing import STALE_S, _line, freeze, needs_second_host

# argv: root, storage options (JSON), where ("save": in save(2)'s capture; "gc": before retention's
# first delete, after save(2) committed).
JOB_A = textwrap.dedent(
    """
    import json, sys, threading, safepoint
    from safepoint.remote.object_layout import RemoteLayout
    root, opts, where = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    paused, resumed = [], threading.Event()

    def say(line):  # one write per line: the retention thread's line never lands inside the main one's
        sys.stdout.write(line + "\\n")
        sys.stdout.flush()

    def pause():
        if not paused:
            paused.append(True)
            say("paused")
            sys.stdin.readline()  # the test freezes A here (SIGSTOP), then resumes it
            resumed.set()
        # Any other thread reaching the point (close's own retention pass) waits for the paused one:
        # a thread past its fence when the test freezes A is the window docs/reliability.md describes.
        resumed.wait()

    real = RemoteLayout.fence
    def fence(self, action):
        if where == "gc" and action.startswith("deleting step"):
            pause()  # before the check: it must see the takeover
        real(self, action)
    RemoteLayout.fence = fence

    class Gate:
        calls = 0
        def state_dict(self):
            Gate.calls += 1
            if where == "save" and Gate.calls > 1:  # the first call is TrainState's check when built
                pause()
            return {"who": "A"}
        def load_state_dict(self, sd):
            pass

    keep = safepoint.Keep(last=1 if where == "gc" else 10)
    cluster = safepoint.ClusterOptions(lease_stale_after_s=STALE)
    mgr = safepoint.CheckpointManager(root, storage_options=opts, cluster=cluster, keep=keep)
    mgr.save(1, safepoint.TrainState(rng=False, extra={"who": "A"}))
    try:
        extra = {"gate": Gate(), "who": "A"} if where == "save" else {"who": "A"}
        mgr.save(2, safepoint.TrainState(rng=False, extra=extra))
        say("A: saved")
    except safepoint.CheckpointError as e:
        say(f"A: refused: {type(e).__name__}: {e}")
    try:
        mgr.close()
    except safepoint.CheckpointError:
        pass
    """
).replace("STALE", repr(STALE_S))

# B, on another host: takes the root over once A's lease is stale, restores, saves steps 2 and 3 (keeping
# everything), then holds the lease until told to finish.
JOB_B = textwrap.dedent(
    """
    import json, socket, sys, time, safepoint
    root, opts = sys.argv[1], json.loads(sys.argv[2])
    cluster = safepoint.ClusterOptions(lease_stale_after_s=STALE)
    deadline = time.monotonic() + 120
    while True:
        try:
            mgr = safepoint.CheckpointManager(root, storage_options=opts, cluster=cluster,
                                              keep=safepoint.Keep(last=10))
            break
        except safepoint.LeaseError:
            assert time.monotonic() < deadline, "the lease of job A never went stale"
            time.sleep(0.1)  # polling the lease's age: only how soon B notices, never what it sees
    state = safepoint.TrainState(rng=False, extra={"who": None})
    restored = mgr.restore(state)
    for step in (2, 3):
        mgr.save(step, safepoint.TrainState(rng=False, extra={"who": "B"}))
    print("B: restored", restored, "committed on", socket.gethostname(), flush=True)
    sys.stdin.readline()
    mgr.close()
    """
).replace("STALE", repr(STALE_S))


def _objects(store: Store, url: str) -> dict[str, str]:
    """{key: sha256} of every object under the root but the lease and the run journal (B's, live)."""
    fs = store.fs()
    prefix = url.split("://", 1)[1]
    return {
        k: hashlib.sha256(fs.cat_file(f"{prefix}/{k}")).hexdigest() for k in store.keys(url) if k != ".lease"
    }


@needs_second_host
@pytest.mark.parametrize(  # on S3 by default; GCS and Azure under -m slow (the suite's time)
    "store",
    ["s3", pytest.param("gs", marks=pytest.mark.slow), pytest.param("az", marks=pytest.mark.slow)],
    indirect=True,
)
@pytest.mark.parametrize("where", ["save", "gc"])
def test_a_holder_frozen_past_its_lease_neither_commits_nor_deletes(store: Store, where: str) -> None:
    url = store.root()
    opts = json.dumps(store.options)
    a = PipedJob(["-c", JOB_A, url, opts, where], stderr=None)
    b: PipedJob | None = None
    try:
        said = [_line(a)]
        while said[-1] != "paused":  # (retention runs on its own thread: save(2) returns first)
            assert said[-1], said
            said.append(_line(a))
        freeze(a.pid)  # every thread of A stops: its lease heartbeat too
        assert a.stdin is not None
        a.stdin.write("go\n")  # read once A runs again
        a.stdin.flush()
        b = PipedJob(["-c", JOB_B, url, opts], hostname="nodeB")
        verdict_b = _line(b)
        # B restored A's newest: step 1 in a save frozen before its commit, step 2 where A had committed
        # it and froze in retention.
        assert verdict_b == f"B: restored {1 if where == 'save' else 2} committed on nodeB", verdict_b
        before = _objects(store, url)
        lease_before = json.loads(store.fs().cat_file(f"{url.split('://', 1)[1]}/.lease"))
        os.kill(a.pid, signal.SIGCONT)
        out, err = a.communicate(timeout=120)
        assert err is not None
        assert a.returncode == 0, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        verdict = " ".join(said[:-1] + out.splitlines())
        assert _objects(store, url) == before, "the frozen holder changed the root after the takeover"
        lease = json.loads(store.fs().cat_file(f"{url.split('://', 1)[1]}/.lease"))
        assert lease["token"] == lease_before["token"] and lease["host"] == "nodeB"
        if where == "save":
            assert verdict.startswith("A: refused: "), verdict
            assert "not committing step 2" in verdict and "nodeB" in verdict, verdict
        else:  # step 2 was committed before the freeze; the delete of step 1 is what is refused
            assert verdict == "A: saved", verdict
            assert "step-1/safepoint.json" in before
            refusal = [line for line in err.splitlines() if "not deleting step 1" in line]
            assert refusal and "nodeB" in refusal[0], err[-3000:]
    finally:
        if b is not None:
            _finish(b)
        if a.poll() is None:
            os.kill(a.pid, signal.SIGCONT)
            a.kill()
            a.wait()
    # Every checkpoint there is intact: A's step 1 (and, committed before the freeze, step 2: B restored
    # it, and a save of the step just restored is not written again), B's steps 2 (or 3) and 3.
    theirs = {1: "A", 2: "A" if where == "gc" else "B", 3: "B"}
    for step in (1, 2, 3):
        state = safepoint.TrainState(rng=False, extra={"who": None})
        with safepoint.CheckpointManager(url, storage_options=store.options) as mgr:
            assert mgr.restore(state, step=step) == step
        assert state.extra["who"] == theirs[step]


def _finish(job: PipedJob) -> None:
    if job.poll() is None and job.stdin is not None:
        job.stdin.write("done\n")
        job.stdin.flush()
    job.wait(timeout=60)
