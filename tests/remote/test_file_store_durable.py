"""A path (``file://``) durable root on a local disk: an upload that finished is on the disk, files and
directory entries alike. Proved under the torture suite's power-loss model (tests/torture/durable.py: what
is not fsync'd, contents or directory entries, is lost): the child uploads, the parent rebuilds what a
power loss right after it could leave and restores from that."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import safepoint
from tests.torture import durable as model

_CHILD = textwrap.dedent(
    """
    import sys, torch, safepoint
    from tests.torture import faults
    scope, durable, local, journal = sys.argv[1:5]
    faults.install(faults.Layer(scope, journal))
    state = safepoint.TrainState(model=torch.nn.Linear(4, 4), rng=False)
    with safepoint.CheckpointManager(durable, local_root=local) as mgr:
        mgr.save(1, state)
        mgr.wait()
    """
)


@pytest.mark.parametrize("fresh", [False, True], ids=["existing root", "root made by the job"])
def test_an_uploaded_step_survives_a_power_loss(tmp_path: Path, fresh: bool) -> None:
    # The model covers `scope`; a root the job makes (and its parent directory) must be durable as well.
    scope, journal = tmp_path / "scope", tmp_path / "journal"
    durable, local = scope / "deep" / "durable", tmp_path / "local"
    (scope if fresh else durable).mkdir(parents=True)
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, str(scope), str(durable), str(local), str(journal)],
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    after = tmp_path / "after"
    model.rebuild_power(model.read(journal), after)
    with safepoint.CheckpointManager(after / "deep" / "durable") as mgr:
        assert [c.step for c in mgr.list()] == [1]  # listed, every file there and intact
        state = safepoint.TrainState(model=torch.nn.Linear(4, 4), rng=False)
        assert mgr.restore(state) == 1
