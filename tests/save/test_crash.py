"""Real SIGKILLs at random points during saves (and retention): restore always returns a committed step
whose tensors are exactly that step's, and no pending state is ever listed or loaded."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

import safepoint
from tests.helpers.example_runs import PipedJob, run_job
from tests.torture.kills import sleep_into_save


def _check_restorable(root: Path) -> int:
    """In this (fresh) process: restore and check the restored state is exactly one step's."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    extra: dict[str, object] = {"step": -1}
    with safepoint.CheckpointManager(root) as mgr:
        listed = [c.step for c in mgr.list()]
        step = mgr.restore(safepoint.TrainState(model=model, optimizer=opt, extra=extra))
        # Taking ownership cleaned every abandoned save.
        assert not list((root / ".pending").iterdir())
    if step == 0:
        assert listed == []
        return 0
    assert step == max(listed)
    assert extra["step"] == step
    for p in model.parameters():
        assert torch.all(p == step), "parameters from another step: torn checkpoint"
    for st in opt.state.values():
        assert torch.all(st["exp_avg"] == step) and torch.all(st["exp_avg_sq"] == step)
    return step


def _kill_campaign(root: Path, kills: int, seed: int, mode: str = "") -> list[int]:
    rng = random.Random(seed)
    # ``python -m tests.helpers.procs.zygote`` with pipes to its stdin and stdout, forked from the suite's
    # fork server (torch and safepoint imported already: ~5 s of CPU less per campaign; the zygote forks
    # the killed savers itself). The tag reaches the ranks and their writer processes: other tests'
    # writers (pytest-xdist runs tests side by side) are never counted as this campaign's orphans.
    tag = {"SAFEPOINT_TEST_TAG": str(root)}
    zygote = PipedJob(["-m", "tests.helpers.procs.zygote"], extra_env=tag, per_run=tuple(tag))
    assert zygote.stdin is not None and zygote.stdout is not None
    restored = []
    last = 0
    pid = 0
    try:
        for _ in range(kills):
            zygote.stdin.write(f"RUN {root} {last} {mode}".rstrip() + "\n")
            zygote.stdin.flush()
            announced = zygote.stdout.readline()
            assert announced.startswith("PID "), announced
            pid = int(announced.split()[1])
            # Let it complete a random number of saves, then kill at a random moment inside the next one.
            target = rng.randint(1, 3)
            ends = 0
            durations: list[float] = []
            began = time.monotonic()
            for line in zygote.stdout:
                if line.startswith("BEGIN"):
                    began = time.monotonic()
                elif line.startswith("END"):
                    durations.append(time.monotonic() - began)
                    ends += 1
                    if ends >= target:
                        break
            sleep_into_save(rng, durations)
            os.kill(pid, signal.SIGKILL)
            for line in zygote.stdout:
                if line.startswith("EXIT"):
                    pid = 0  # reaped: the number may be reused, never signal it again
                    assert os.waitstatus_to_exitcode(int(line.split()[1])) == -signal.SIGKILL
                    break
            last = _check_restorable(root)
            restored.append(last)
    finally:
        # A campaign cut short (a failed check, the time limit) must not leave its child saving on: it
        # would go on for up to 1000 steps, loading the machine under the tests that follow.
        with contextlib.suppress(ProcessLookupError):
            if pid:
                os.kill(pid, signal.SIGKILL)
        zygote.stdin.close()
        try:
            zygote.wait(timeout=30)
        except subprocess.TimeoutExpired:
            zygote.kill()
            zygote.wait()
    return restored


def _sync_campaign(tmp_path: Path, kills: int, seed: int) -> None:
    restored = _kill_campaign(tmp_path / "ckpt", kills=kills, seed=seed)
    assert restored[-1] > 0
    assert restored == sorted(restored), "a committed checkpoint was lost"


def test_sigkill_during_save_4_times(tmp_path: Path) -> None:
    # 4 in the default suite (its time bar); 200 under -m slow below
    _sync_campaign(tmp_path, kills=4, seed=1)


def _orphaned_writers(tag: str) -> list[int]:
    """Writer processes (async_writer="process") of this campaign (``tag``) whose rank is gone."""
    found = []
    for p in psutil.process_iter(["cmdline", "ppid"]):
        ppid = int(p.info["ppid"] or 0)
        orphan = ppid in (0, 1) or not psutil.pid_exists(ppid)  # reparented once its rank died
        if "safepoint.save.writer_child" in " ".join(p.info["cmdline"] or []) and orphan:
            with contextlib.suppress(psutil.Error):
                if p.environ().get("SAFEPOINT_TEST_TAG") == tag:
                    found.append(p.pid)
    return found


def _async_campaign(tmp_path: Path, kills: int, seed: int) -> None:
    """Async saves written by a writer process: the rank is SIGKILLed at random moments, mid-write of the
    previous save included. Every restore is exactly one committed step, and no writer outlives its rank."""
    restored = _kill_campaign(tmp_path / "ckpt", kills=kills, seed=seed, mode="async")
    assert restored == sorted(restored), "a committed checkpoint was lost"
    tag = str(tmp_path / "ckpt")
    deadline = time.monotonic() + 10
    while _orphaned_writers(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _orphaned_writers(tag) == [], "a writer process outlived its rank"


def test_sigkill_during_async_process_saves(tmp_path: Path) -> None:
    _async_campaign(tmp_path, kills=3, seed=3)


@pytest.mark.slow
def test_sigkill_during_async_process_saves_30_times(tmp_path: Path) -> None:
    _async_campaign(tmp_path, kills=30, seed=4)


@pytest.mark.slow
@pytest.mark.timeout(1500)  # ~1-2 s per kill on a loaded 2-core machine: beyond the default 300 s
def test_sigkill_during_save_200_times(tmp_path: Path) -> None:
    _sync_campaign(tmp_path, kills=200, seed=2)


def test_kill_mid_delete_leaves_no_half_checkpoint(tmp_path: Path) -> None:
    """Retention moves a step out of sight in one rename, then deletes: a kill midway through the deletes
    (one file of the step gone) leaves nothing that looks valid, and the next owner cleans up."""
    root = tmp_path / "ckpt"
    # A step directory holds no subdirectory, so it is deleted entry by entry (rootfs: guard.remove_flat),
    # not by rmtree (which once carried this hook: the kill then never came, and the test saw exit 0).
    script = f"""
import os, signal, shutil, torch, safepoint, safepoint.store.rootfs as R
m = torch.nn.Linear(4, 4)
with safepoint.CheckpointManager({str(root)!r}, keep=safepoint.Keep(last=1)) as mgr:
    st = safepoint.TrainState(model=m)
    mgr.save(1, st)
    def die_midway(name, dfd):
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
        os.unlink(sorted(os.listdir(fd))[0], dir_fd=fd)
        os.kill(os.getpid(), signal.SIGKILL)
    def die(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)
    die.avoids_symlink_attacks = True  # the deleter refuses an rmtree that could follow symlinks
    R.remove_flat, shutil.rmtree = die_midway, die
    mgr.save(2, st)
"""
    # Forked from the suite's fork server (its own process, killed for real; ~4.5 s of CPU less than a fresh
    # interpreter, which is not the subject).
    proc = run_job(["-c", script], timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert not (root / "step-1").exists()
    leftovers = list((root / ".pending").iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.startswith("deleting-step-1")
    with safepoint.CheckpointManager(root) as mgr:
        assert [c.step for c in mgr.list()] == [2]
        assert mgr.restore(safepoint.TrainState(model=torch.nn.Linear(4, 4))) == 2
    assert not list((root / ".pending").iterdir())
