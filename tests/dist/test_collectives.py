"""Collectives per save and per restore stay at most one above plain DCP's (issue 15, item 4).

A real torchrun job (benchmarks/collectives.py) wraps every public collective of torch.distributed with a
counter and counts them around a steady-state ``mgr.save``, ``mgr.restore``, and plain ``dcp.save`` /
``dcp.load`` of the same state on the same group. safepoint's own traffic is one broadcast per save (rank
0's verdict; DCP's write collective carries each rank's file list) and one per restore (the chosen step and
its manifest; each rank's verification and the state check ride on DCP's plan collective).

The torchrun agents are forked from a fork server (tests/helpers/launch.py); their ranks are fresh processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, SUBPROCESS_ENV
from tests.helpers.launch import run_agent


@pytest.mark.parametrize("ranks", [2])
def test_save_and_restore_run_at_most_one_collective_more_than_plain_dcp(tmp_path: Path, ranks: int) -> None:
    out = tmp_path / "counts.json"
    cmd = [
        "--standalone", f"--nproc-per-node={ranks}",
        str(REPO / "benchmarks" / "collectives.py"), str(out), str(tmp_path / "roots"),
    ]  # fmt: skip
    proc = run_agent(cmd, SUBPROCESS_ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(out.read_text())
    total = {name: sum(calls.values()) for name, calls in counts.items() if name != "world"}
    assert total["safepoint_save"] <= total["dcp_save"] + 1, counts
    assert total["safepoint_restore"] <= total["dcp_load"] + 1, counts
    # Gathers go to rank 0: no all-gather of safepoint's own in a save.
    assert counts["safepoint_save"].get("all_gather_object", 0) == 0, counts


@pytest.mark.parametrize("what", ["manifest", pytest.param("data", marks=pytest.mark.slow)])
def test_a_checkpoint_damaged_for_every_rank_is_corrupt_not_a_root_that_is_not_shared(
    tmp_path: Path, what: str
) -> None:
    """The manifest damaged for every rank, or a data file only rank 1 verifies: corruption (fall back),
    never "the root is not shared" nor "ranks see different checkpoints"."""
    out = tmp_path / "out"
    out.mkdir()
    cmd = [
        "--standalone", "--nproc-per-node=2",
        str(REPO / "tests" / "helpers" / "procs" / "corrupt_manifest_worker.py"), str(tmp_path / "ckpt"), str(out),
        what,
    ]  # fmt: skip
    proc = run_agent(cmd, SUBPROCESS_ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(out / f"rank{r}").read_text() for r in (0, 1)] == ["1", "1"]  # fell back together
    assert "skipping corrupt checkpoint: step 2" in proc.stderr
    assert "different checkpoints" not in proc.stderr and "not shared" not in proc.stderr
    if what == "data":
        assert "(found by rank 1)" in proc.stderr


def test_a_partial_restore_decides_alike_on_every_rank_when_one_cannot_read_the_metadata(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    cmd = [
        "--standalone", "--nproc-per-node=2",
        str(REPO / "tests" / "helpers" / "procs" / "partial_metadata_worker.py"), str(tmp_path), str(out),
    ]  # fmt: skip
    proc = run_agent(cmd, SUBPROCESS_ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcomes = [(out / f"rank{r}").read_text().splitlines() for r in (0, 1)]
    assert outcomes[0] == outcomes[1], outcomes
    strict, partial = outcomes[0]
    assert partial == strict, outcomes  # strict=False decides as the default path does
    assert partial.startswith(
        "CheckpointError: checkpoint step 1: file '.metadata' is intact as seen from rank 0"
    )


def test_init_from_a_path_missing_on_some_ranks_fails_alike_on_every_rank(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    cmd = [
        "--standalone", "--nproc-per-node=2",
        str(REPO / "tests" / "helpers" / "procs" / "warm_start_worker.py"), str(tmp_path), str(out),
    ]  # fmt: skip
    proc = run_agent(cmd, SUBPROCESS_ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcomes = [(out / f"rank{r}").read_text() for r in (0, 1)]
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith("CheckpointError: rank 1: init_from='SOURCE' does not exist"), outcomes
    assert "but the other ranks can read it" in outcomes[0]
