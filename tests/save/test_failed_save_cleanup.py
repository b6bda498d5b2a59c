"""A failed save whose files could not be deleted at once is deleted by the next save, not left in
``.pending`` until the next owner's start.

Two real ways to get there: the torture campaigns' fault layer (tests/torture/faults.py: every write, unlink
and rmdir under the root fails with EIO from the save's first write on, after its directory was made, until
the layer is disarmed), and, through an async save, the process running out of descriptors (deleting a
directory tree needs them too)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.example_runs import run_job

_FAULTS = """
import os, sys, torch, safepoint
from safepoint.store import heartbeat
from tests.torture import faults
heartbeat.HEARTBEAT_S = 86400.0  # no lease write lands in the faulty window
root, journal = sys.argv[1], sys.argv[2]
m = torch.nn.Linear(64, 64)
mgr = safepoint.CheckpointManager(root, cluster=safepoint.ClusterOptions(lease_stale_after_s=4 * 86400.0))
def save(step):
    try:
        mgr.save(step, safepoint.TrainState(model=m, rng=False)); return "ok"
    except safepoint.SaveError as e:
        return "failed" if "(injected)" in str(e) else repr(e)
print(save(1))
layer = faults.install(faults.Layer(root, journal, mode="fail", sticky=("write", "unlink", "rmdir")))
with torch.no_grad():
    m.weight.add_(1.0)  # new bytes to write (an unchanged model's data files are linked from step 1)
layer.tripped = True  # from now on every write, unlink and rmdir under the root fails (sticky kinds)
print(save(2))
layer.disarm()
print(len(os.listdir(os.path.join(root, ".pending"))))
print(save(3))
print(sorted(os.listdir(os.path.join(root, ".pending"))), [c.step for c in mgr.list()])
mgr.close()
"""

_SCRIPT = """
import os, sys, torch, safepoint
root = sys.argv[1]
m = torch.nn.Linear(64, 64)
mgr = safepoint.CheckpointManager(root, async_save=sys.argv[2] == "async")
def save(step):
    try:
        mgr.save(step, safepoint.TrainState(model=m, rng=False)); mgr.wait(); return "ok"
    except safepoint.SaveError as e:
        return "failed" if "Too many open files" in str(e) else repr(e)
print(save(1))
# Every descriptor taken but ``spare``: with none spare the save fails before its directory exists (the
# guarded walk opens ROOT first, store/rootfs.py), so a few are left until one fails with its directory
# made, or succeeds.
for spare in range(64):
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    for fd in held[len(held) - spare:]:
        os.close(fd)
    got = save(2)
    for fd in held[:len(held) - spare]:
        os.close(fd)
    left = len(os.listdir(os.path.join(root, ".pending")))
    if got != "failed" or left:
        break
print(got)
print(left)
print(save(3))
print(sorted(os.listdir(os.path.join(root, ".pending"))), [c.step for c in mgr.list()])
mgr.close()
"""


def _run(script: str, *args: str) -> list[str]:
    """``python -c SCRIPT ARGS`` forked from the fork server (tests/helpers/example_runs.py ``run_job``): the
    script needs a process of its own (it exhausts its descriptors), not a fresh interpreter."""
    out = run_job(["-c", script, *args], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()


def test_the_next_save_deletes_what_a_failed_save_could_not(root: Path, tmp_path: Path) -> None:
    lines = _run(_FAULTS, str(root), str(tmp_path / "journal"))
    assert lines[:2] == ["ok", "failed"], lines
    assert int(lines[2]) >= 1  # the failed save's directory could not be deleted then
    assert lines[3:] == ["ok", "[] [1, 3]"]


def test_the_same_through_an_async_save(root: Path) -> None:
    """Through an async save the guarded walk needs one descriptor at a time: with none spare the save
    fails before its directory exists, with one it succeeds; either way nothing is left in .pending."""
    lines = _run(_SCRIPT, str(root), "async")
    assert lines[0] == "ok" and lines[1] in ("ok", "failed"), lines
    assert lines[3] == "ok" and lines[4].startswith("[] "), lines
