"""Per-node local tiers in one process (tiers/node_tiers.py, tiers/peers.py): where a restore takes each file
from, and which copies it refuses. The multi-node behaviour runs in tests/dist/test_nodes.py; here a
one-rank NodeView reads a real checkpoint (saved by a real manager with a local and a durable tier)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import safepoint
from safepoint.dist import Comm
from safepoint.remote.object_layout import RemoteLayout
from safepoint.store.node_map import NodeMap, node_id
from safepoint.store.posix_layout import Layout
from safepoint.tiers.node_tiers import _assign
from safepoint.tiers.node_view import NodeView
from safepoint.tiers.peers import MAX_RECORD_BYTES, PEERS_DIR, REPLICA_NAME, share
from tests.helpers.train import Setup


def _saved(tmp_path: Path) -> tuple[Layout, RemoteLayout, str]:
    """A checkpoint of step 3 on a local and a durable tier; returns them and its DCP data file."""
    setup = Setup(seed=0)
    with safepoint.CheckpointManager(tmp_path / "durable", local_root=tmp_path / "local") as mgr:
        mgr.save(3, setup.state())
        mgr.wait()
    local = Layout(tmp_path / "local")
    data = next(n for n in local.read_manifest(3).files if n.endswith(".distcp"))
    return local, RemoteLayout("file://" + str(tmp_path / "durable")), data


def _view(local: Layout, durable: RemoteLayout) -> NodeView:
    view = NodeView(local, durable, NodeMap(rank=0, nodes=("a",)))
    manifest = view.choose(Comm(), None, None)
    assert manifest is not None and manifest.step == 3
    return view


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_verified_local_copy_is_read_and_an_altered_one_is_not(tmp_path: Path) -> None:
    local, durable, data = _saved(tmp_path)
    view = _view(local, durable)
    view.paths([data, ".metadata"])
    assert view.sources == {data: "local", ".metadata": "local"}
    _flip(local.step_path(3) / data)
    view = _view(local, durable)
    path = view.paths([data])[data]
    assert view.sources == {data: "durable"}
    assert Path(path).read_bytes() == (tmp_path / "durable" / "step-3" / data).read_bytes()
    view.cleanup()
    assert not Path(path).exists()  # the download is removed once loaded


def _replica(local: Layout, names: list[str], save_id: str) -> Path:
    manifest = local.read_manifest(3)
    rep = local.root / PEERS_DIR / "step-3"
    rep.mkdir(parents=True)
    for n in names:
        shutil.copy(local.step_path(3) / n, rep / n)
    files = {n: [manifest.files[n].size, manifest.files[n].crc32c] for n in names}
    (rep / REPLICA_NAME).write_text(json.dumps({"step": 3, "save_id": save_id, "files": files}))
    return rep


def test_a_replica_is_read_only_if_it_verifies_against_the_durable_manifest(tmp_path: Path) -> None:
    local, durable, data = _saved(tmp_path)
    save_id = local.read_manifest(3).save_id
    rep = _replica(local, [data], save_id)
    (local.step_path(3) / data).unlink()  # this node's own copy is gone
    view = _view(local, durable)
    view.paths([data])
    assert view.sources == {data: "peer"}
    _flip(rep / data)
    view = _view(local, durable)
    view.paths([data])
    assert view.sources == {data: "durable"}
    shutil.rmtree(rep.parent)
    _replica(local, [], "another-save")  # a replica of another save of the same step is never used
    view = _view(local, durable)
    view.paths([data])
    assert view.sources == {data: "durable"}


def test_uploads_take_each_file_from_a_node_that_holds_it() -> None:
    names = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    held = [
        ("s1", [".metadata", "__0_0.distcp", "__2_0.distcp"], names),  # rank 0 holds rank 2's file too
        ("s1", ["__1_0.distcp"], []),
        ("s0", ["__2_0.distcp"], []),  # an older save of the step: not this one
    ]
    assert _assign(held, 0) == ([".metadata", "__0_0.distcp", "__2_0.distcp"], [])
    assert _assign(held, 1) == (["__1_0.distcp"], [])
    assert _assign(held, 2) == ([], [])
    held[1] = (None, [], [])  # rank 1's node lost its disk
    assert _assign(held, 0)[1] == ["__1_0.distcp"]


def test_a_nodes_share_is_metadata_and_its_ranks_files(tmp_path: Path) -> None:
    local, _, _ = _saved(tmp_path)
    manifest = local.read_manifest(3)
    manifest.files = {n: manifest.files[".metadata"] for n in (".metadata", "__0_0.distcp", "__1_0.distcp")}
    assert share(NodeMap(rank=1, nodes=("a", "b")), manifest) == [".metadata", "__1_0.distcp"]
    assert share(NodeMap(rank=0, nodes=("a", "a")), manifest) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_a_node_is_named_by_env_else_host_and_torchrun_group(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SAFEPOINT_NODE_ID", "rack3-n7")
    assert node_id() == "rack3-n7"
    monkeypatch.delenv("SAFEPOINT_NODE_ID")
    monkeypatch.setenv("GROUP_RANK", "2")
    import socket

    assert node_id() == f"{socket.gethostname()}/2"


def test_a_replica_record_that_is_not_one_is_corrupt_and_not_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica record that parses as something else (``[]``), is too large, or is a FIFO: "corrupt, not
    used", one warning, and the file comes from the durable tier (the FIFO never blocks the read)."""
    local, durable, data = _saved(tmp_path)
    rep = _replica(local, [data], local.read_manifest(3).save_id)
    (local.step_path(3) / data).unlink()
    record = rep / REPLICA_NAME
    for plant in ("[]", "huge", "fifo"):
        record.unlink()
        if plant == "fifo":
            os.mkfifo(record)
        else:
            record.write_text("[]" if plant == "[]" else " " * (MAX_RECORD_BYTES + 1))
        caplog.clear()
        view = _view(local, durable)
        view.paths([data])
        assert view.sources == {data: "durable"}, plant
        assert "is corrupt, not used" in caplog.text, plant


def test_a_replica_file_that_became_a_fifo_is_not_read(tmp_path: Path) -> None:
    """The replica file is swapped for a FIFO after the restore chose the replica (between its look and its
    read): checksummed through a plain open, it blocked the restore forever."""
    local, durable, data = _saved(tmp_path)
    rep = _replica(local, [data], local.read_manifest(3).save_id)
    (local.step_path(3) / data).unlink()
    view = _view(local, durable)  # the replica is chosen here
    (rep / data).unlink()
    os.mkfifo(rep / data)
    view.paths([data])
    assert view.sources == {data: "durable"}


def test_a_replica_record_that_lies_is_no_replica(tmp_path: Path) -> None:
    """replica.json as ``[]`` (was AttributeError in start and restore), with NaN, nested 2,000 deep, or
    with ``files`` of the wrong type: a warning, and the file comes from the durable tier."""
    local, durable, data = _saved(tmp_path)
    save_id = local.read_manifest(3).save_id
    rep = _replica(local, [data], save_id)
    (local.step_path(3) / data).unlink()
    good = (rep / REPLICA_NAME).read_text()
    for text in (
        "[]",
        good.replace('"step": 3', '"step": NaN'),
        good.replace('"step": 3', '"step": ' + "[" * 2000 + "]" * 2000),
        json.dumps({"step": 3, "save_id": save_id, "files": []}),
        json.dumps({"step": 3, "save_id": 7, "files": {}}),
    ):
        (rep / REPLICA_NAME).write_text(text)
        view = _view(local, durable)
        view.paths([data])
        assert view.sources == {data: "durable"}, text[:40]
