"""Leases across PID namespaces (issue 23): a live holder in another PID namespace with the same host name
(containers with host networking, a sidecar) is never judged by ``kill(pid, 0)``: there its pid names
another process, or none. Its heartbeat decides. `safepoint prune` from such a sidecar refuses in one line
while the holder runs, and ``--force`` takes the lease over (fencing the holder) instead of racing it.

Real processes in real namespaces: ``unshare --pid --fork --mount-proc`` (root here)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import safepoint
from tests.conftest import REPO, SUBPROCESS_ENV


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        return (
            subprocess.run(
                ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


pytestmark = pytest.mark.skipif(not _unshare_works(), reason="needs unshare --pid (root)")
NS = ["unshare", "--pid", "--fork", "--mount-proc"]

HOLDER = """
import sys, time, torch, safepoint
from safepoint.errors import CheckpointError
mgr = safepoint.CheckpointManager(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()  # the test says when to try a save
try:
    mgr.save(9, safepoint.TrainState(model=torch.nn.Linear(2, 2)))
    print("saved", flush=True)
except CheckpointError as e:
    print("refused", e, flush=True)
"""


def _holder(root: Path, in_ns: bool) -> subprocess.Popen[str]:
    cmd = [*(NS if in_ns else []), sys.executable, "-c", HOLDER, str(root)]
    proc = subprocess.Popen(
        cmd, env=SUBPROCESS_ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _cli(root: Path, in_ns: bool, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [*(NS if in_ns else []), sys.executable, "-m", "safepoint.cli", "prune", str(root), *args]
    return subprocess.run(cmd, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=240, cwd=REPO)


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


# The holder in its own namespace by default; the mirror case (the sidecar in one) under -m slow.
@pytest.mark.parametrize(
    "holder_in_ns",
    [pytest.param(False, marks=pytest.mark.slow), True],
    ids=["sidecar-in-namespace", "holder-in-namespace"],
)
def test_a_live_holder_in_another_pid_namespace_is_never_taken_over(root: Path, holder_in_ns: bool) -> None:
    with safepoint.CheckpointManager(root) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, safepoint.TrainState(model=torch.nn.Linear(2, 2)))
    holder = _holder(root, holder_in_ns)
    try:
        lease = json.loads((root / ".lease").read_text())
        assert lease["host"] == socket.gethostname() and lease["pid_ns"] and lease["boot_id"]
        # Was: the sidecar's kill(pid, 0) found no such process (or another one) and deleted while it ran.
        done = _cli(root, not holder_in_ns, "--keep-last", "1")
        assert done.returncode == 2, done.stdout + done.stderr
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "not pruning" in done.stderr and "--force" in done.stderr, done.stderr
        assert _steps(root) == ["step-1", "step-2", "step-3"]
        # --force takes the lease over: the deletes are fenced by it, and the holder is fenced out.
        forced = _cli(root, not holder_in_ns, "--keep-last", "1", "--force")
        assert forced.returncode == 0, forced.stdout + forced.stderr
        assert _steps(root) == ["step-3"]
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.write("save\n")
        holder.stdin.flush()
        said = holder.stdout.readline()
        assert said.startswith("refused") and "no longer owns the root" in said, said
        assert _steps(root) == ["step-3"]
    finally:
        holder.kill()
        holder.wait(timeout=60)


@pytest.mark.slow  # the same judgement as the holder-in-namespace case, waited out to its end
def test_a_manager_in_another_namespace_waits_for_the_heartbeat(root: Path) -> None:
    """A second job started in its own PID namespace on the same host is refused while the holder beats."""
    holder = _holder(root, in_ns=False)
    try:
        code = "import sys, safepoint; safepoint.CheckpointManager(sys.argv[1])"
        proc = subprocess.run(
            [*NS, sys.executable, "-c", code, str(root)],
            env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=240, cwd=REPO,
        )  # fmt: skip
        assert proc.returncode != 0 and "is in use by" in proc.stderr, proc.stderr
    finally:
        holder.kill()
        holder.wait(timeout=60)


@pytest.mark.parametrize("pid", [10**30, -1, 0, 2**22 + 1, True, "12"])
def test_a_lease_pid_that_is_no_process_is_judged_by_its_heartbeat(root: Path, pid: object) -> None:
    """pid 10**30 overflowed kill() (a traceback); -1 (kill(-1, 0) reaches every process) counted as alive
    forever. Now: no process can be asked; a fresh heartbeat refuses, an old one is taken over."""
    from safepoint.store.heartbeat import namespace_identity

    boot, pid_ns = namespace_identity()
    root.mkdir(parents=True)
    lease = root / ".lease"
    rec = {"host": socket.gethostname(), "pid": pid, "boot_id": boot, "pid_ns": pid_ns}
    lease.write_text(json.dumps({**rec, "heartbeat": time.time(), "token": "theirs"}))
    with pytest.raises(safepoint.LeaseError, match="is in use by") as e:
        safepoint.CheckpointManager(root)
    assert "\n" not in str(e.value)
    old = time.time() - 3600
    os.utime(lease, (old, old))  # the heartbeat (the file's mtime) stopped an hour ago
    with safepoint.CheckpointManager(root):
        assert json.loads(lease.read_text())["pid"] == os.getpid()
