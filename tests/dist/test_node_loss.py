"""A node dies with its disk and rejoins (issue 15, item 6), on a simulated cluster (tests/helpers/cluster.py).
In its own file so that the test runner's workers run it beside test_nodes.py."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from pathlib import Path

from tests.helpers.cluster import Cluster, equal, exactly_once, records, wait_for


def test_a_node_dies_with_its_disk_and_rejoins(tmp_path: Path) -> None:
    """Issue 15, item 6: a two-node elastic job (``--nnodes=1:2``) loses a whole node (agent and worker
    SIGKILLed) and its local_root; the survivor re-rendezvous alone and resumes from the last durable
    checkpoint (its own files from its disk, the lost node's from the durable tier); the node rejoins
    with an empty disk and the job finishes at full size. Every sample is seen once per epoch, and the
    final state is bitwise equal to a reference run with the same world-size schedule."""
    out, durable = tmp_path / "out", tmp_path / "durable"
    out.mkdir()
    local_a, local_b = tmp_path / "localA", tmp_path / "localB"
    # Steps 1-7 on two nodes (saves at 3 and 6), node B dies at 7; 7-9 alone (save at 9); 10-12 on two.
    cfg = {"durable": str(durable), "end": 12, "save_every": 3, "block_at": 7, "pause_at": 9}
    cluster = Cluster(out, cfg, "1:2", max_restarts=3)
    try:
        a = cluster.node("nodeA", local_a)
        cluster.listening(a)  # node A hosts the rendezvous: killing it would end the job (docs/elastic.md)
        b = cluster.node("nodeB", local_b)
        wait_for(out / "blocked", [a, b])
        pids = json.loads((out / "blocked").read_text())
        first = records(out)
        rank_b = next(r["rank"] for r in first if r["event"] == "step" and Path(r["local"]) == local_b)
        os.killpg(b.pid, signal.SIGKILL)  # the node: its agent and (in a session of its own) its worker
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[rank_b], signal.SIGKILL)
        b.wait()
        shutil.rmtree(local_b)
        wait_for(out / "paused", [a])  # node A alone resumed and saved step 9
        cluster.node("nodeB", local_b)  # the node comes back, its disk empty
        cluster.wait(skip=("nodeB-1",))
    finally:
        cluster.kill()
    log = records(out)
    restored = [(r["world"], r["step"]) for r in log if r["event"] == "restored"]
    assert restored == [(2, 0), (2, 0), (1, 6), (2, 9), (2, 9)], restored
    # Node A alone: its own files from its disk, node B's from the replica B had sent it.
    alone = next(r for r in log if r["event"] == "restored" and r["step"] == 6)
    mine, theirs = f"__{1 - rank_b}_0.distcp", f"__{rank_b}_0.distcp"  # by node A's and B's ranks
    assert alone["files"] == {".metadata": "local", mine: "local", theirs: "peer"}, alone
    for r in (r for r in log if r["event"] == "restored" and r["step"] == 9):
        if Path(r["local"]) == local_b:  # the rejoined node has nothing: A sends it its share
            assert r["files"][".metadata"] == "peer" and "local" not in r["files"].values(), r
        else:  # node A saved step 9 alone: every file it reads is on its own disk
            assert set(r["files"].values()) == {"local"}, r
    exactly_once(log)

    # The reference: one node, the same schedule (2 ranks to step 6, 1 rank to 9, 2 ranks to 12).
    ref = tmp_path / "ref"
    ref.mkdir()
    for nproc, end in ((2, 6), (1, 9), (2, 12)):
        run = Cluster(
            ref, {"durable": str(tmp_path / "ref-durable"), "end": end, "save_every": 3}, "1", 0, nproc
        )
        try:
            run.node("ref", tmp_path / "ref-local")
            run.wait()
        finally:
            run.kill()
    equal(ref / "final.pt", out / "final.pt")


