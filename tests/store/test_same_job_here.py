"""A live process of the same job on this host is never taken over (an evaluation in the same allocation
opening the trainer's root to restore): it restores without the lease, with a warning, its saves refuse,
it cleans nothing, and the trainer keeps saving. Across hosts a restart of the same job still takes over
at once (tests/store/test_job_lease.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch

import safepoint
from tests.helpers.example_runs import run_job

EVAL = textwrap.dedent(
    """
    import sys, torch, safepoint
    cluster = safepoint.ClusterOptions(job_id="run-a")
    state = safepoint.TrainState(model=torch.nn.Linear(2, 2))
    with safepoint.CheckpointManager(sys.argv[1], cluster=cluster) as mgr:
        print("restored", mgr.restore(state), flush=True)
        try:
            mgr.save(5, state)
            print("saved 5")
        except safepoint.LeaseError as e:
            print("save refused:", e)
    """
)


def test_a_live_process_of_the_same_job_on_this_host_is_never_taken_over(root: Path) -> None:
    cluster = safepoint.ClusterOptions(job_id="run-a")
    state = safepoint.TrainState(model=torch.nn.Linear(2, 2))
    with safepoint.CheckpointManager(root, cluster=cluster) as trainer:
        trainer.save(1, state)
        in_flight = root / ".pending" / "step-2"  # the trainer's save in flight, as the eval opens
        in_flight.mkdir(parents=True)
        # Another process on this host, forked from the suite's fork server (~4.5 s of CPU less than a fresh
        # interpreter, which is not the subject).
        done = run_job(["-c", EVAL, str(root)], timeout=300)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.strip().splitlines()
        assert lines[0] == "restored 1", done.stdout
        assert lines[1].startswith("save refused: not saving step 5:"), lines
        assert "a live process of this same job ('job:run-a')" in lines[1], lines
        assert "restoring without the lease, and saves will fail" in done.stderr, done.stderr
        assert in_flight.is_dir()  # nothing of the trainer's was cleaned
        in_flight.rmdir()
        trainer.save(2, state)  # the trainer still owns the root
        assert [c.step for c in trainer.list()] == [1, 2]
