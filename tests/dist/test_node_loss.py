"""A node dies with its disk and rejoins (issue 15, item 6), on a simulated cluster (tests/helpers/cluster.py).
In its own file so that the test runner's workers run it beside test_nodes.py."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from tests.helpers.cluster import Cluster, equal, exactly_once, records, wait_for


@pytest.mark.parametrize(
    "nproc", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)]
)
def test_a_node_dies_with_its_disk_and_rejoins(tmp_path: Path, nproc: int) -> None:
    """Issue 15, item 6: a two-node elastic job (``--nnodes=1:2``) loses a whole node (agent and worker
    SIGKILLed) and its local_root; the survivor re-rendezvous alone and resumes from the last durable
    checkpoint (its own files from its disk, the lost node's from the replica it kept); the node rejoins
    with an empty disk (its share sent by the survivor) and the job finishes at full size. Every sample is seen once per epoch, and the
    final state is bitwise equal to a reference run with the same world-size schedule. One rank per node
    by default; two (4 -> 2 -> 4 ranks) under ``-m slow``."""
    out, durable = tmp_path / "out", tmp_path / "durable"
    out.mkdir()
    local_a, local_b = tmp_path / "localA", tmp_path / "localB"
    # Steps 1-7 on two nodes (saves at 3 and 6), node B dies at 7; 7-9 alone (save at 9); 10-12 on two.
    full, half = 2 * nproc, nproc
    cfg = {"durable": str(durable), "end": 12, "save_every": 3, "block_at": 7, "pause_at": 9, "full": full}
    cluster = Cluster(out, cfg, "1:2", max_restarts=3, nproc=nproc)
    try:
        a = cluster.node("nodeA", local_a)
        cluster.listening(a)  # node A hosts the rendezvous: killing it would end the job (docs/elastic.md)
        b = cluster.node("nodeB", local_b)
        wait_for(out / "blocked", [a, b])
        pids = json.loads((out / "blocked").read_text())
        first = records(out)
        ranks_b = {r["rank"] for r in first if r["event"] == "step" and Path(r["local"]) == local_b}
        os.killpg(b.pid, signal.SIGKILL)  # the node: its agent and (in sessions of their own) its workers
        for rank in ranks_b:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[rank], signal.SIGKILL)
        b.wait()
        shutil.rmtree(local_b)
        wait_for(out / "paused", [a])  # node A alone resumed and saved step 9
        cluster.node("nodeB", local_b)  # the node comes back, its disk empty
        cluster.wait(skip=("nodeB-1",))
    finally:
        cluster.kill()
    log = records(out)
    restored = [(r["world"], r["step"]) for r in log if r["event"] == "restored"]
    assert restored == [(full, 0)] * full + [(half, 6)] * half + [(full, 9)] * full, restored
    # Node A alone: its ranks' files from its disk, node B's from the replica B had sent it.
    theirs = {f"__{r}_0.distcp" for r in ranks_b}
    alone = [r for r in log if r["event"] == "restored" and r["step"] == 6]
    for r in alone:
        assert all((where == "peer") == (f in theirs) for f, where in r["files"].items()), r
    assert any(f in theirs for r in alone for f in r["files"]), alone  # B's files were read
    for r in (r for r in log if r["event"] == "restored" and r["step"] == 9):
        if Path(r["local"]) == local_b:  # the rejoined node has nothing: A sends it its share
            assert r["files"][".metadata"] == "peer" and "local" not in r["files"].values(), r
        else:  # node A saved step 9 alone: every file it reads is on its own disk
            assert set(r["files"].values()) == {"local"}, r
    exactly_once(log)

    # The reference: one node, the same schedule (full to step 6, half to 9, full to 12).
    ref = tmp_path / "ref"
    ref.mkdir()
    for ranks, end in ((full, 6), (half, 9), (full, 12)):
        run = Cluster(
            ref, {"durable": str(tmp_path / "ref-durable"), "end": end, "save_every": 3}, "1", 0, ranks
        )
        try:
            run.node("ref", tmp_path / "ref-local")
            run.wait()
        finally:
            run.kill()
    equal(ref / "final.pt", out / "final.pt")
