"""Incremental saves across a restart (store/incremental_record.py): real processes, a real kill -9. The
restarted job's first save links the frozen base from the step the killed one committed, after checking its
bytes against that step's manifest; a tampered step is not linked from.

The jobs are forked from the fork server (tests/helpers/example_runs.py ``run_job``): a real process of its
own, killed with a real kill -9; what is tested is the record a process leaves and the next one reads, not
the interpreter's start (which cost ~4.5 s of CPU a job). The async job's state is small: "auto" writes it
with the writer thread (no writer process)."""

from __future__ import annotations

import json
import os
import signal
import tempfile
from pathlib import Path

import pytest
import torch

import safepoint
from safepoint.cli.main import main
from safepoint.store.storage import read_metadata_file
from tests.helpers.example_runs import run_job, spawn_job
from tests.save._restart_job import FROZEN, Job

JOB = ["-m", "tests.save._restart_job"]


def _run(root: Path, last: int, mode: str, *flags: str) -> dict[int, int]:
    """Run the job to step ``last`` to its end; {step: bytes_skipped} of its saves."""
    out = run_job([*JOB, str(root), str(last), mode, *flags], timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return _skipped(out.stdout)


def _skipped(stdout: str) -> dict[int, int]:
    return {int(w[1]): int(w[2]) for line in stdout.splitlines() if (w := line.split())[:1] == ["skipped"]}


def _run_and_kill(root: Path, last: int, mode: str) -> None:
    """Run the job to step ``last`` and kill -9 it once that step is committed."""
    out_r, out_w = os.pipe()
    with tempfile.TemporaryFile() as err:
        try:
            proc = spawn_job([*JOB, str(root), str(last), mode, "hang"], out_w, err.fileno())
        except BaseException:
            os.close(out_r)
            raise
        finally:
            os.close(out_w)
        try:
            with open(out_r) as stdout:
                for line in stdout:
                    if line.strip() == "HANG":
                        break
                else:
                    err.seek(0)
                    raise AssertionError(f"the job ended early: {err.read().decode(errors='replace')}")
                os.kill(proc.pid, signal.SIGKILL)  # the job only: its writer process ends on its own
                proc.wait(timeout=60)
        finally:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)


def _file_of(root: Path, step: int, fqn: str) -> Path:
    md = read_metadata_file(root / f"step-{step}" / ".metadata")
    names = {info.relative_path for idx, info in md.storage_data.items() if idx.fqn == fqn}
    assert len(names) == 1, names
    return root / f"step-{step}" / names.pop()


def _restored(root: Path) -> dict[str, torch.Tensor]:
    model = Job()
    with safepoint.CheckpointManager(root) as mgr:
        mgr.restore(safepoint.TrainState(model=model))
    return model.state_dict()


# sync under -m slow for the default suite's time: the async case goes through the same persisted record
# (and staging's fingerprints on top); the tampered-record cases below restart with sync saves.
@pytest.mark.parametrize("mode", [pytest.param("sync", marks=pytest.mark.slow), "async"])
def test_the_first_save_after_a_kill_links_the_frozen_base(root: Path, mode: str) -> None:
    _run_and_kill(root, 2, mode)  # step 2 put the base in a stable group
    base = _file_of(root, 2, "model.base")
    skipped = _run(root, 3, mode)
    # The restarted process's first save: the stable group is the very inode of step 2.
    assert skipped[3] >= FROZEN * 4, skipped
    assert _file_of(root, 3, "model.base").stat().st_ino == base.stat().st_ino
    assert (root / "step-3" / "rank-0.fingerprints").is_file()
    assert main(["verify", str(root), "--all"]) == 0
    # Bit for bit: the restarted run's state at step 3, and the same state reached without any restart.
    # The straight run saves synchronously: the state it reaches does not depend on the mode, and it spares
    # a writer process (the restarted run above is the one under test).
    other = root.parent / "straight"
    _run(other, 3, "sync")
    for k, v in _restored(other).items():
        assert torch.equal(_restored(root)[k], v), k


def test_a_tampered_previous_step_is_not_linked_from(root: Path) -> None:
    _run(root, 2, "sync")
    base = _file_of(root, 2, "model.base")
    # The restarted job damages the base's file after its restore read it: its fingerprint still matches
    # the record, but the file no longer holds what the manifest says, so it is written again.
    skipped = _run(root, 3, "sync", "tamper")
    assert skipped[3] < FROZEN * 4, skipped
    assert _file_of(root, 3, "model.base").stat().st_ino != base.stat().st_ino
    assert main(["verify", str(root), "--step", "3"]) == 0
    torch.manual_seed(1234)
    made = Job().base.detach().clone()  # the frozen base as the job made it
    assert torch.equal(_restored(root)["base"], made)


def test_a_tampered_fingerprint_record_is_not_trusted(root: Path) -> None:
    _run(root, 2, "sync")
    record = root / "step-2" / "rank-0.fingerprints"
    body = json.loads(record.read_text())
    body["fingerprints"] = [[fqn, off, "0" * 32] for fqn, off, _ in body["fingerprints"]]
    record.write_text(json.dumps(body))  # its crc32c no longer matches the manifest
    skipped = _run(root, 3, "sync")
    assert skipped[3] == 0, skipped
    assert main(["verify", str(root), "--step", "3"]) == 0
