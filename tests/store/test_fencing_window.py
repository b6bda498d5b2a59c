"""The fencing window (issue 13, finding 2, residual): an owner frozen *after* its fence check passed, just
before the commit makes step N visible, whose root another job took over meanwhile, must not replace the
step N the new owner committed: locally the rename refuses a step-N that appeared since the fence (the
decision to replace is taken before it), on an object store the manifest is created only if absent.

Real processes: job A freezes inside its commit (a hook after the real fence check announces itself, the
test SIGSTOPs A there); job B runs as another host (a UTS namespace of its own), takes the root over once A's lease
is stale, commits steps 2 and 3; then A resumes. Sequenced by pipes, never by sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import safepoint
from tests.helpers.example_runs import PipedJob
from tests.helpers.s3 import storage_options
from tests.store.test_fencing import STALE_S, _line, freeze, needs_second_host

# argv: root, storage options (JSON). Saves step 1, then step 2, which stops right after its commit fence.
JOB_A = textwrap.dedent(
    """
    import json, sys, safepoint
    from safepoint.remote.object_layout import RemoteLayout
    from safepoint.store.posix_layout import Layout
    root, opts = sys.argv[1], json.loads(sys.argv[2])

    def hook(cls):
        real = cls.fence
        def fence(self, action):
            real(self, action)  # the real check: raises LeaseError once the root is someone else's
            if action == "committing step 2":
                print("fenced", flush=True)
                sys.stdin.readline()  # the test freezes A here (SIGSTOP), after the check passed
        cls.fence = fence

    hook(Layout)
    hook(RemoteLayout)
    kw = {"storage_options": opts} if opts else {}
    mgr = safepoint.CheckpointManager(root, cluster=safepoint.ClusterOptions(lease_stale_after_s=STALE), **kw)
    mgr.save(1, safepoint.TrainState(rng=False, extra={"who": "A"}))
    try:
        mgr.save(2, safepoint.TrainState(rng=False, extra={"who": "A"}))
        print("A: committed", flush=True)
    except safepoint.CheckpointError as e:
        print(f"A: refused: {type(e).__name__}: {e}", flush=True)
    try:
        mgr.close()
    except safepoint.CheckpointError:
        pass
    """
).replace("STALE", repr(STALE_S))

JOB_B = textwrap.dedent(
    """
    import json, socket, sys, time, safepoint
    root, opts = sys.argv[1], json.loads(sys.argv[2])
    kw = {"storage_options": opts} if opts else {}
    cluster = safepoint.ClusterOptions(lease_stale_after_s=STALE)
    deadline = time.monotonic() + 120
    while True:
        try:
            mgr = safepoint.CheckpointManager(root, cluster=cluster, **kw)
            break
        except safepoint.LeaseError:
            assert time.monotonic() < deadline, "the lease of job A never went stale"
            time.sleep(0.1)  # polling the lease's age: only how soon B notices, never what it sees
    for step in (2, 3):
        mgr.save(step, safepoint.TrainState(rng=False, extra={"who": "B"}))
    print("B: committed on", socket.gethostname(), flush=True)
    sys.stdin.readline()
    mgr.close()
    """
).replace("STALE", repr(STALE_S))


def _spawn(argv: list[str], hostname: str | None = None) -> PipedJob:
    # The suite's job environment (os.environ: the moto fixture sets its dummy AWS keys after conftest's
    # import), forked from its fork server (tests/store/test_fencing.py ``_spawn``).
    return PipedJob(argv, hostname=hostname)


def _frozen_after_the_fence(
    tmp: Path, root: str, opts: dict[str, Any], manifests: Callable[[], dict[int, bytes]]
) -> str:
    """Run A to its commit fence of step 2, freeze it, let B take over and commit 2 and 3, resume A.
    Returns A's verdict line; asserts B's manifests are untouched."""
    a = _spawn(["-c", JOB_A, root, json.dumps(opts)])
    b: PipedJob | None = None
    try:
        assert _line(a) == "fenced"
        freeze(a.pid)  # frozen after its fence check passed, before the commit
        assert a.stdin is not None
        a.stdin.write("go\n")  # read once A runs again
        a.stdin.flush()
        job_b = tmp / "job_b.py"
        job_b.write_text(JOB_B)
        b = _spawn([str(job_b), root, json.dumps(opts)], hostname="nodeB")
        assert _line(b) == "B: committed on nodeB"
        before = manifests()
        os.kill(a.pid, signal.SIGCONT)
        verdict = _line(a)
        assert a.wait(timeout=120) == 0
        assert manifests() == before, "the stale owner changed the new owner's checkpoints"
        return verdict
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


def _restores_bs_steps(root: str, opts: dict[str, Any]) -> None:
    kw: dict[str, Any] = {"storage_options": opts} if opts else {}
    for step in (2, 3):
        state = safepoint.TrainState(rng=False, extra={"who": None})
        with safepoint.CheckpointManager(root, **kw) as mgr:
            assert mgr.restore(state, step=step) == step
        assert state.extra == {"who": "B"}


@needs_second_host
def test_a_stale_owner_frozen_after_its_fence_cannot_replace_the_new_owners_step(root: Path) -> None:
    """It used to: step-2 existed when A resumed, so A "replaced" it (an atomic exchange) with its own."""

    def manifests() -> dict[int, bytes]:
        return {s: (root / f"step-{s}" / "safepoint.json").read_bytes() for s in (2, 3)}

    verdict = _frozen_after_the_fence(root.parent, str(root), {}, manifests)
    assert verdict.startswith("A: refused: "), verdict
    assert "taken over by" in verdict and "nodeB" in verdict, verdict
    assert not [p for p in (root / ".pending").iterdir() if "step-2" in p.name]  # A's copy cleaned up
    _restores_bs_steps(str(root), {})


@needs_second_host
@pytest.mark.slow  # the local variant runs by default
def test_a_stale_owner_frozen_after_its_fence_cannot_replace_the_new_owners_step_on_s3(
    moto_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    """It used to overwrite B's manifest (an unconditional write), then, refused, delete B's step 2 while
    discarding its own in-place save."""
    import boto3

    url, opts = f"s3://{bucket}/run", storage_options(moto_endpoint)
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")

    def manifests() -> dict[int, bytes]:
        return {
            s: s3.get_object(Bucket=bucket, Key=f"run/step-{s}/safepoint.json")["Body"].read() for s in (2, 3)
        }

    verdict = _frozen_after_the_fence(tmp_path, url, opts, manifests)
    assert verdict.startswith("A: refused: "), verdict
    assert "nodeB" in verdict, verdict
    _restores_bs_steps(url, opts)


def test_a_manifest_create_refused_by_its_own_earlier_write_is_a_commit(
    moto_endpoint: str, bucket: str
) -> None:
    """A create whose answer was lost is retried and refused (the object exists): finding its own bytes
    there, the commit succeeded; another writer's bytes are a refusal and left alone."""
    from safepoint.remote.conditional import create_if_absent
    from safepoint.remote.object_layout import RemoteLayout

    layout = RemoteLayout(f"s3://{bucket}/run", storage_options(moto_endpoint))
    path = layout.object_key(1, "safepoint.json")
    assert create_if_absent(layout.store, path, b"mine")
    assert create_if_absent(layout.store, path, b"mine")  # the retry after a lost answer
    assert not create_if_absent(layout.store, path, b"theirs")
    assert layout.store.get_bytes(path) == b"mine"


@pytest.mark.parametrize("kind", ["commit", "replace", "delete"])
def test_a_step_replaced_since_the_fence_is_put_back_untouched(root: Path, kind: str) -> None:
    """Committing, replacing or deleting step N moves exactly the step-N this owner decided on (before its
    fence): a step-N that another writer put there since is never replaced (a commit's rename refuses it; a
    replacement or delete moves it back), and the owner is told. (Across processes the new owner's cleanup
    of .pending usually removes the stale owner's save first; this is the window that remains.)"""
    from safepoint.store.posix_layout import Layout

    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, safepoint.TrainState(rng=False, extra={"who": "A"}))
        mgr.save(2, safepoint.TrainState(rng=False, extra={"who": "A"}))
        layout = mgr.layout
        assert isinstance(layout, Layout)
        theirs = root / "theirs"
        real = type(layout).fence
        swapped: list[bool] = []

        def fence(self: Layout, action: str) -> None:
            real(self, action)
            wanted = "deleting step 1" if kind == "delete" else "committing step 1"
            if action == wanted and not swapped:
                swapped.append(True)
                # After the check: another writer's step-1 takes the place of the one decided on.
                if kind != "commit":
                    (root / "step-1").rename(root / ".pending" / "old-step-1")
                theirs.mkdir()
                (theirs / "safepoint.json").write_text("theirs")
                theirs.rename(root / "step-1")

        layout.fence = fence.__get__(layout)  # type: ignore[method-assign]
        if kind == "commit":  # step 1 did not exist when this owner decided to commit it
            layout.remove(1)
        match = "step-1 or .* changed meanwhile" if kind == "commit" else "step-1 was replaced meanwhile"
        with pytest.raises(safepoint.CheckpointError, match=match):
            if kind in ("commit", "replace"):
                try:
                    mgr.save(1, safepoint.TrainState(rng=False, extra={"who": "A again"}))
                except safepoint.SaveError as e:
                    raise safepoint.CheckpointError(str(e)) from e
            else:
                layout.remove(1)
        assert (root / "step-1" / "safepoint.json").read_text() == "theirs"
