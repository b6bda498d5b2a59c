"""Per-node tiers and peer replicas under a hostile ``local_root`` (issue 23, the file-access findings), on a
simulated cluster (tests/helpers/cluster.py): two torchrun agents, each its own node with its own
``local_root``, the durable tier a directory. Real symlinks and FIFOs are planted in a node's root between
launches; nothing outside the roots may be read, written or deleted, and nothing may block.

nodeA's agent has the lower address, so it is rank 0 in every launch (tests/helpers/cluster.py)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

import tests.helpers.cluster as cluster_module
from tests.conftest import REPO
from tests.helpers.cluster import WORKER, Cluster, equal, records

FILES = [".metadata", "__0_0.distcp", "__1_0.distcp", "rank-0.fingerprints", "rank-0.state"]
FILES += ["rank-1.fingerprints", "rank-1.state"]
HOSTILE = REPO / "tests" / "helpers" / "procs" / "hostile_worker.py"


def _launch(
    out: Path, cfg: dict[str, Any], locals_: dict[str, Path], timeout: float = 240, worker: Path = WORKER
) -> list[Any]:
    """One launch of the two-node job (of ``worker``); a launch that does not end within ``timeout`` fails
    the test (a blocked rank is a finding, not something to wait out)."""
    (out / "log.jsonl").unlink(missing_ok=True)
    # Cluster starts the script its module names; the phases' worker runs that script's code phase by phase.
    with mock.patch.object(cluster_module, "WORKER", worker):
        cluster = Cluster(out, cfg, "2")
        try:
            for i, (name, local) in enumerate(sorted(locals_.items())):
                cluster.node(name, local, addr=f"127.0.0.{i + 1}")  # nodeA: rank 0
            cluster.wait(timeout=timeout)
        finally:
            cluster.kill()
    return records(out) if worker == WORKER else []  # hostile_worker.py logs in each phase's own out


def _tree(path: Path) -> dict[str, bytes | str]:
    """What is under ``path`` (files' bytes, symlinks' targets), to compare before and after."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirs, files in os.walk(path):
        for n in dirs + files:
            p = Path(dirpath) / n
            rel = str(p.relative_to(path))
            out[rel] = os.readlink(p) if p.is_symlink() else (b"" if p.is_dir() else p.read_bytes())
    return out


def _victim(path: Path) -> dict[str, bytes | str]:
    """A directory outside every root, with a subdirectory of its own and one named like a step."""
    for sub in ("precious", "step-2"):
        (path / sub).mkdir(parents=True)
        (path / sub / "keep.txt").write_text(f"{sub}: not safepoint's")
    return _tree(path)


def _peers_phase(base: Path) -> tuple[dict[str, Any], dict[str, dict[str, bytes | str]]]:
    """The symlinked-peers save: ``local_root/.peers`` a symlink to a directory outside every root."""
    locals_, before = {"nodeA": base / "localA", "nodeB": base / "localB"}, {}
    for name, local in locals_.items():
        local.mkdir(parents=True)
        before[name] = _victim(base / f"home-{name}")
        (local / ".peers").symlink_to(base / f"home-{name}")
    (base / "out").mkdir()
    cfg = {
        "out": str(base / "out"),
        "durable": str(base / "durable"),
        "end": 2,
        "save_every": 2,
        "tag": "saved",
    }
    return dict(cfg, locals={k: str(v) for k, v in locals_.items()}), before


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, bytes | str]]]:
    """One launch, two saves of step 2 in turn (hostile_worker.py), each with roots of its own: the
    symlinked-peers one first (as in a fresh job), then the clean one ``saved`` copies. Ranks are fresh
    interpreters that cost seconds of CPU each, so the two saves share them."""
    base = tmp_path_factory.mktemp("launched")
    peers, before = _peers_phase(base / "peers")
    saved = base / "saved"
    (saved / "out").mkdir(parents=True)
    locals_ = {"nodeA": saved / "localA", "nodeB": saved / "localB"}
    clean = {"out": str(saved / "out"), "durable": str(saved / "durable"), "end": 2, "save_every": 2}
    clean |= {"tag": "saved", "locals": {k: str(v) for k, v in locals_.items()}}
    nodes = {name: Path(name) for name in locals_}  # the worker maps each node to its phase's local root
    _launch(base, {"phases": [peers, clean]}, nodes, worker=HOSTILE)
    return base, before


@pytest.fixture(scope="module")
def saved(launched: tuple[Path, dict[str, dict[str, bytes | str]]]) -> Path:
    """One two-node save of step 2 (durable + both nodes' local tiers and replicas), copied by each test."""
    base = launched[0] / "saved"
    for local in (base / "localA", base / "localB"):
        assert (local / ".peers" / "step-2" / "replica.json").is_file()
    return base


def _copy(saved: Path, tmp_path: Path) -> tuple[Path, Path, dict[str, Path]]:
    shutil.copytree(saved, tmp_path / "job", symlinks=True)
    job = tmp_path / "job"
    (job / "out" / "log.jsonl").unlink(missing_ok=True)
    return job / "out", job / "durable", {"nodeA": job / "localA", "nodeB": job / "localB"}


def _restore(out: Path, durable: Path, locals_: dict[str, Path], timeout: float = 240) -> dict[int, Any]:
    cfg = {"durable": str(durable), "restore_only": True, "tag": "restored"}
    got = {r["rank"]: r for r in _launch(out, cfg, locals_, timeout) if r["event"] == "restored"}
    assert sorted((r, g["step"]) for r, g in got.items()) == [(0, 2), (1, 2)], got
    equal(out.parent / "out" / "saved.pt", out / "restored.pt")
    return got


def test_a_symlinked_peers_directory_deletes_nothing_outside_the_root(
    launched: tuple[Path, dict[str, dict[str, bytes | str]]],
) -> None:
    """Critical: ``local_root/.peers`` a symlink to a directory elsewhere. On the old code one save deleted
    every subdirectory there (the old replica, then "the other steps"). Its save is the first phase of the
    module's launch (``launched``)."""
    base, before = launched[0] / "peers", launched[1]
    durable = base / "durable"
    locals_ = {"nodeA": base / "localA", "nodeB": base / "localB"}
    for name, local in locals_.items():
        assert _tree(base / f"home-{name}") == before[name], name
        assert (local / ".peers").is_symlink()  # left where it is, and reported
    assert sorted(json.loads((durable / "step-2" / "safepoint.json").read_text())["files"]) == FILES


@pytest.mark.slow  # a high finding; the critical one and the FIFO run by default (time bar)
def test_a_planted_metadata_part_symlink_is_not_written_through(saved: Path, tmp_path: Path) -> None:
    """High: a node that keeps a copy of ``.metadata`` (after an upload) downloads it to
    ``step-N/.metadata.part``; a symlink planted there was written through (outside the root)."""
    out, durable, locals_ = _copy(saved, tmp_path)
    node_b = locals_["nodeB"] / "step-2"  # rank 1's node: it keeps a copy of the .metadata rank 0 wrote
    (node_b / ".metadata").unlink()
    victim = tmp_path / "victim.txt"
    victim.write_text("not safepoint's")
    (node_b / ".metadata.part").symlink_to(victim)
    shutil.rmtree(durable / "step-2")  # not durable: the next start uploads it, then node B keeps .metadata
    _restore(out, durable, locals_)
    assert victim.read_bytes() == b"not safepoint's"
    assert not (node_b / ".metadata.part").is_symlink()
    assert (node_b / ".metadata").read_bytes() == (durable / "step-2" / ".metadata").read_bytes()


def test_a_fifo_as_replica_record_neither_blocks_nor_stops_the_job(saved: Path, tmp_path: Path) -> None:
    """High: ``.peers/step-N/replica.json`` as a FIFO blocked the node leader forever in start(). Now the
    replica is "corrupt: not used" (one line) and the job restores, the peer's file from the durable tier."""
    out, durable, locals_ = _copy(saved, tmp_path)
    for local in locals_.values():
        record = local / ".peers" / "step-2" / "replica.json"
        record.unlink()
        os.mkfifo(record)
    got = _restore(out, durable, locals_, timeout=150)
    assert dict(got[0]["files"])["__1_0.distcp"] == "durable", got[0]
    logs = "".join(p.read_text() for p in out.glob("agent-*.log"))
    assert "not a regular file" in logs and "Traceback" not in logs


@pytest.mark.slow  # a medium finding; the critical and high ones run by default
def test_a_symlinked_pending_is_neither_written_through_nor_emptied(saved: Path, tmp_path: Path) -> None:
    """Medium: a restore writes the files a peer sends into ``.pending/peer-restore-step-N-<save id>`` and
    removes that directory afterwards; through a symlinked ``.pending`` both happened outside the root."""
    out, durable, locals_ = _copy(saved, tmp_path)
    save_id = json.loads((durable / "step-2" / "safepoint.json").read_text())["save_id"]
    before = {}
    for name, local in locals_.items():
        elsewhere = tmp_path / f"elsewhere-{name}"
        (elsewhere / f"peer-restore-step-2-{save_id}").mkdir(parents=True)
        (elsewhere / f"peer-restore-step-2-{save_id}" / "keep.txt").write_text("not safepoint's")
        before[name] = _tree(elsewhere)
        shutil.rmtree(local / ".pending")
        (local / ".pending").symlink_to(elsewhere)
    (locals_["nodeB"] / "step-2" / ".metadata").unlink()  # rank 1's node lacks it: node A sends it
    got = _restore(out, durable, locals_)
    for name in locals_:
        assert _tree(tmp_path / f"elsewhere-{name}") == before[name], name
    # Not received (no .pending to receive into), node B reads .metadata from the replica it keeps of
    # node A's share.
    assert dict(got[1]["files"])[".metadata"] == "peer", got[1]
    logs = "".join(p.read_text() for p in out.glob("agent-*.log"))
    assert ".metadata from a peer not kept" in logs


@pytest.mark.slow  # a medium finding; the critical and high ones run by default
def test_replica_files_that_are_symlinks_out_of_the_root_are_not_read(saved: Path, tmp_path: Path) -> None:
    """Medium: a replica file that is a symlink to a file outside the root (here a copy with the right
    bytes, so only the link itself is wrong) was read as the peer's copy."""
    out, durable, locals_ = _copy(saved, tmp_path)
    for name, local in locals_.items():
        replica = local / ".peers" / "step-2"
        for f in replica.glob("__*_0.distcp"):
            outside = tmp_path / f"outside-{name}-{f.name}"
            shutil.copy(f, outside)
            f.unlink()
            f.symlink_to(outside)
    got = _restore(out, durable, locals_)
    assert dict(got[0]["files"])["__1_0.distcp"] == "durable", got[0]
