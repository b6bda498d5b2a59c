"""A path (``file://``) durable root on a local disk: an upload that finished is on the disk, files and
directory entries alike. Proved under the torture suite's power-loss model (tests/torture/durable.py: what
is not fsync'd, contents or directory entries, is lost): the child uploads, the parent rebuilds what a
power loss right after it could leave and restores from that."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import safepoint
from tests.torture import durable as model

_CHILD = textwrap.dedent(
    """
    import sys, torch, safepoint
    from tests.torture import faults
    durable, local, journal = sys.argv[1:4]
    faults.install(faults.Layer(durable, journal))
    state = safepoint.TrainState(model=torch.nn.Linear(4, 4), rng=False)
    with safepoint.CheckpointManager(durable, local_root=local) as mgr:
        mgr.save(1, state)
        mgr.wait()
    """
)


def test_an_uploaded_step_survives_a_power_loss(tmp_path: Path) -> None:
    durable, local, journal = tmp_path / "durable", tmp_path / "local", tmp_path / "journal"
    durable.mkdir()
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, str(durable), str(local), str(journal)],
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    after = tmp_path / "after"
    model.rebuild_power(model.read(journal), after)
    with safepoint.CheckpointManager(after) as mgr:
        assert [c.step for c in mgr.list()] == [1]  # listed, every file there and intact
        state = safepoint.TrainState(model=torch.nn.Linear(4, 4), rng=False)
        assert mgr.restore(state) == 1
