"""One live writer per root: a second one gets a clear error naming the holder; a dead one's lease is taken
over; read-only use needs no lease."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import safepoint
from safepoint.layout import Layout
from tests.conftest import REPO


def test_second_live_writer_is_refused_in_process(root: Path) -> None:
    with safepoint.CheckpointManager(root):
        with pytest.raises(safepoint.LeaseError, match=rf"in use by pid {os.getpid()} on host"):
            safepoint.CheckpointManager(root)
    # Released on close: a new owner is fine.
    safepoint.CheckpointManager(root).close()


def test_live_writer_in_another_process_is_refused(root: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import safepoint, sys; m = safepoint.CheckpointManager({str(root)!r}); print('ok', flush=True); "
            "sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO / "src")),
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ok"
        with pytest.raises(safepoint.LeaseError, match=rf"pid {holder.pid} on host '{socket.gethostname()}'"):
            safepoint.CheckpointManager(root)
        # Read-only use needs no lease.
        assert Layout(root).committed_steps() == []
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)


def test_stale_lease_of_dead_process_is_taken_over(root: Path) -> None:
    # A real process that held the lease and died without releasing it (SIGKILL).
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import os, signal, safepoint; m = safepoint.CheckpointManager({str(root)!r}); "
            "m.save(1, safepoint.TrainState(rng=False, extra={'a': 1})); os.kill(os.getpid(), signal.SIGKILL)",
        ],
        env=dict(os.environ, PYTHONPATH=str(REPO / "src")),
    )
    assert proc.wait(timeout=60) == -9
    lease = json.loads((root / ".lease").read_text())
    assert lease["pid"] == proc.pid and lease["host"] == socket.gethostname()
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.latest_step() == 1
        assert json.loads((root / ".lease").read_text())["pid"] == os.getpid()


def test_stale_lease_from_other_host_by_heartbeat(root: Path) -> None:
    root.mkdir(parents=True)
    rec = {"host": "elsewhere", "pid": 1, "heartbeat": 0.0, "token": "x"}
    (root / ".lease").write_text(json.dumps(rec))
    safepoint.CheckpointManager(root).close()
    import time

    rec["heartbeat"] = time.time()
    (root / ".lease").write_text(json.dumps(rec))
    with pytest.raises(safepoint.LeaseError, match="host 'elsewhere'"):
        safepoint.CheckpointManager(root)


def test_lease_error_is_a_checkpoint_error_and_exception() -> None:
    assert issubclass(safepoint.LeaseError, safepoint.CheckpointError)
    assert issubclass(safepoint.CheckpointError, Exception)


def test_unwritable_root_gives_clear_error(tmp_path: Path) -> None:
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(safepoint.CheckpointError, match="cannot create checkpoint root"):
        safepoint.CheckpointManager(f / "sub")
    torch.manual_seed(0)
