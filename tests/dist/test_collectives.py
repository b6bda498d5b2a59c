"""Collectives per save and per restore stay at most one above plain DCP's (issue 15, item 4), and the small
two-rank scenarios where one rank sees something the other does not end alike on every rank.

A real torchrun job counts, with benchmarks/collectives.py's counters (which wrap every public collective of
torch.distributed), the collectives around a steady-state ``mgr.save``, ``mgr.restore``, and plain
``dcp.save`` / ``dcp.load`` of the same state on the same group. safepoint's own traffic is one broadcast
per save (rank 0's verdict; DCP's write collective carries each rank's file list) and one per restore (the
chosen step and its manifest; each rank's verification and the state check ride on DCP's plan collective).

Every rank of a torchrun job is a fresh interpreter that costs seconds of CPU before it does anything, so the
default scenarios share one job (tests/helpers/procs/collectives_worker.py runs them in turn, each ending
with the ranks in step, the counts first as in a fresh process); each test asserts on its scenario's
outcome and on what the ranks wrote to stderr during it. The slow ``data`` case has a job of its own.

The torchrun agents are forked from a fork server (tests/helpers/launch.py); their ranks are fresh processes.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, SUBPROCESS_ENV
from tests.helpers.launch import run_agent

WORKER = REPO / "tests" / "helpers" / "procs" / "collectives_worker.py"
SHARED = ("counts", "manifest", "partial", "warm")  # the default scenarios, in one job
Job = tuple[subprocess.CompletedProcess[str], Path]


def _job(base: Path, scenarios: tuple[str, ...]) -> Job:
    out = base / "out"
    out.mkdir()
    cmd = ["--standalone", "--nproc-per-node=2", str(WORKER), str(base / "work"), str(out), *scenarios]
    return run_agent(cmd, SUBPROCESS_ENV, timeout=600), out


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return _job(tmp_path_factory.mktemp("collectives"), SHARED)


def _outcome(job: Job, scenario: str) -> tuple[list[str], str]:
    """The scenario's outcome per rank (rank 0's only for ``counts``) and both ranks' stderr during it."""
    proc, out = job
    logs = "".join(p.read_text() for p in sorted((out / scenario).glob("stderr-rank*")))
    assert proc.returncode == 0, proc.stderr[-3000:] + logs[-3000:]
    ranks = (0,) if scenario == "counts" else (0, 1)
    return [(out / scenario / f"rank{r}").read_text() for r in ranks], logs


@pytest.mark.parametrize("ranks", [2])
def test_save_and_restore_run_at_most_one_collective_more_than_plain_dcp(job: Job, ranks: int) -> None:
    counts = json.loads(_outcome(job, "counts")[0][0])
    assert counts["world"] == ranks, counts
    total = {name: sum(calls.values()) for name, calls in counts.items() if name != "world"}
    assert total["safepoint_save"] <= total["dcp_save"] + 1, counts
    assert total["safepoint_restore"] <= total["dcp_load"] + 1, counts
    # Gathers go to rank 0: no all-gather of safepoint's own in a save.
    assert counts["safepoint_save"].get("all_gather_object", 0) == 0, counts


@pytest.mark.parametrize("what", ["manifest", pytest.param("data", marks=pytest.mark.slow)])
def test_a_checkpoint_damaged_for_every_rank_is_corrupt_not_a_root_that_is_not_shared(
    request: pytest.FixtureRequest, tmp_path: Path, what: str
) -> None:
    """The manifest damaged for every rank, or a data file only rank 1 verifies: corruption (fall back),
    never "the root is not shared" nor "ranks see different checkpoints"."""
    job: Job = request.getfixturevalue("job") if what in SHARED else _job(tmp_path, (what,))
    outcomes, stderr = _outcome(job, what)
    assert outcomes == ["1", "1"]  # fell back together
    assert "skipping corrupt checkpoint: step 2" in stderr
    for text in (stderr, job[0].stderr):
        assert "different checkpoints" not in text and "not shared" not in text
    if what == "data":
        assert "(found by rank 1)" in stderr


def test_a_partial_restore_decides_alike_on_every_rank_when_one_cannot_read_the_metadata(job: Job) -> None:
    outcomes = [text.splitlines() for text in _outcome(job, "partial")[0]]
    assert outcomes[0] == outcomes[1], outcomes
    strict, partial = outcomes[0]
    assert partial == strict, outcomes  # strict=False decides as the default path does
    assert partial.startswith(
        "CheckpointError: checkpoint step 1: file '.metadata' is intact as seen from rank 0"
    )


def test_init_from_a_path_missing_on_some_ranks_fails_alike_on_every_rank(job: Job) -> None:
    outcomes = _outcome(job, "warm")[0]
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith("CheckpointError: rank 1: init_from='SOURCE' does not exist"), outcomes
    assert "but the other ranks can read it" in outcomes[0]
