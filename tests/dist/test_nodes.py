"""Per-node local tiers (issue 15, item 2) on a simulated cluster (tests/helpers/cluster.py): two torchrun
agents, each its own node with its own ``local_root``; the durable tier is a local directory. The worker
(FSDP2) puts each rank's shards in its own file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from safepoint.cli.main import main
from tests.helpers.cluster import UNSHARE, equal, run


def test_each_node_commits_and_restores_from_its_own_local_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, durable = tmp_path / "out", tmp_path / "durable"
    out.mkdir()
    locals_ = {"nodeA": tmp_path / "localA", "nodeB": tmp_path / "localB"}
    saved = run(out, {"durable": str(durable), "end": 4, "save_every": 2, "tag": "saved"}, locals_)
    hosts = {r["rank"]: r["host"] for r in saved if r["event"] == "finished"}
    assert len(set(hosts.values())) == 2 or not UNSHARE
    # The global commit is the durable manifest; each node's local step holds its own rank's file.
    manifest = json.loads((durable / "step-4" / "safepoint.json").read_text())
    files = [".metadata", "__0_0.distcp", "__1_0.distcp", "rank-0.fingerprints", "rank-0.state"]
    files += ["rank-1.fingerprints", "rank-1.state"]
    assert sorted(manifest["files"]) == files
    node_of = _node_of_rank(saved, locals_)
    for rank in (0, 1):
        local = node_of[rank] / "step-4"
        assert (local / f"__{rank}_0.distcp").is_file()
        assert (local / f"rank-{rank}.state").is_file()  # its RNG, data position, extra
        assert not (local / f"__{1 - rank}_0.distcp").exists()  # never on another node's disk
        assert not (local / f"rank-{1 - rank}.state").exists()
        assert (local / ".metadata").is_file()  # rank 0 wrote it; the other node keeps a verified copy
        assert json.loads((local / "safepoint.json").read_text())["save_id"] == manifest["save_id"]

    # `safepoint verify` on a node's local_root: its own share is checked and the rest is known to be the
    # other node's (the manifest records each node's ranks), not reported as missing.
    for rank in (0, 1):
        capsys.readouterr()
        assert main(["verify", str(node_of[rank])]) == 0, capsys.readouterr().out
        said = " ".join(capsys.readouterr().out.split())
        assert "node-local copy of" in said and "4 of 7 files here, intact" in said, said
        assert main(["ls", str(node_of[rank]), "--verify", "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)
        assert {(e["step"], e["status"], e["tier"]) for e in listed} >= {(4, "ok", "node")}, listed
    assert main(["verify", str(durable)]) == 0  # the durable root: every file
    assert "7 files" in capsys.readouterr().out
    # The durable root is the whole checkpoint: one node's whole share lost there (a copy of it, here) is
    # damage, never "a node-local copy" (its manifest records no node shares).
    assert "nodes" not in manifest["extra"]
    damaged = tmp_path / "damaged"
    shutil.copytree(durable, damaged)
    for name in ("__1_0.distcp", "rank-1.state"):
        (damaged / "step-4" / name).unlink()
    capsys.readouterr()
    assert main(["verify", str(damaged), "--step", "4"]) == 1, capsys.readouterr().out
    assert "CORRUPT" in capsys.readouterr().out

    # Each node also keeps a replica of the other node's files (peer replicas, item 3).
    for rank in (0, 1):
        replica = node_of[1 - rank] / ".peers" / "step-4"
        assert (replica / f"__{rank}_0.distcp").read_bytes() == (
            node_of[rank] / "step-4" / f"__{rank}_0.distcp"
        ).read_bytes()

    # Three restores in one launch (tests/helpers/procs/nodes_worker.py, ``restores``: each phase a fresh
    # model and manager, as a new launch; the files removed between phases, by rank 0, between barriers).
    lost = node_of[1]
    restores = restore(out, durable, locals_, [
        {"tag": "local"},
        # A node loses its disk.
        {"tag": "peer", "remove": [str(lost)]},
        # And with no replica left either.
        {"tag": "durable", "remove": [str(lost), str(node_of[0] / ".peers")]},
    ])  # fmt: skip

    # Restore: each rank's own shards and .metadata from its node's local copy. DCP also spreads
    # replicated items (AdamW's step counters) over both ranks' files: what a rank reads of the other
    # rank's file comes from the replica its node keeps.
    for r in restores["local"]:
        sources(r, "local", "local", "peer")
    equal(out / "saved.pt", out / "local.pt")

    # A node loses its disk: its rank gets its share from the other node (peer), the rest from the durable
    # tier; the other rank still reads its own disk.
    for r in restores["peer"]:
        if Path(r["local"]) == lost:
            sources(r, "peer", "peer", "durable")
        else:
            sources(r, "local", "local", "peer")
    equal(out / "saved.pt", out / "peer.pt")

    # And with no replica left either: the durable tier.
    for r in restores["durable"]:
        if Path(r["local"]) == lost:
            sources(r, "peer", "durable", "durable")
        else:
            sources(r, "local", "local", "durable")
    equal(out / "saved.pt", out / "durable.pt")


def restore(
    out: Path, durable: Path, locals_: dict[str, Path], phases: list[dict[str, Any]]
) -> dict[str, list[dict[str, Any]]]:
    """A launch that only restores, once per phase (rank 0 dumps the state to OUT/<tag>.pt after each):
    each phase's restore records, by tag."""
    cfg = {"durable": str(durable), "restores": phases}
    records = run(out, cfg, locals_)
    by_tag: dict[str, list[dict[str, Any]]] = {}
    for phase in phases:
        restored = [r for r in records if r["event"] == "restored" and r["tag"] == phase["tag"]]
        assert sorted(r["step"] for r in restored) == [4, 4]
        # The timings, for benchmarks/README.md.
        (out / f"restore-{phase['tag']}.json").write_text(json.dumps(restored))
        by_tag[phase["tag"]] = restored
    return by_tag


def sources(r: dict[str, Any], metadata: str, own: str, other: str) -> None:
    """Where the rank of restore record ``r`` read ``.metadata``, its own file and, if it read from it
    (replicated items: rank 0 does, rank 1 need not), the other rank's file."""
    files = dict(r["files"])
    assert files.pop(".metadata") == metadata, r
    assert files.pop(f"__{r['rank']}_0.distcp") == own, r
    assert files.pop(f"rank-{r['rank']}.state") == own, r  # its RNG and data position: like its shards
    assert files in ({}, {f"__{1 - r['rank']}_0.distcp": other}), r


def _node_of_rank(records: list[dict[str, Any]], locals_: dict[str, Path]) -> dict[int, Path]:
    """rank -> the local_root of the node it ran on."""
    return {r["rank"]: Path(r["local"]) for r in records if r["event"] == "finished"}
