"""Every object store as safe as S3: the same behaviour on S3 (moto), GCS (fake-gcs-server) and Azure
(Azurite), each a real server on loopback reached through its own fsspec file system over HTTP.

A few representative tests run by default for each store; the rest are ``-m slow``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

import safepoint
from safepoint.remote.object_layout import RemoteLayout
from safepoint.store.heartbeat import namespace_identity
from safepoint.store.posix_layout import Layout
from tests.helpers.stores import Store
from tests.helpers.tcpproxy import proxied_options
from tests.helpers.train import Setup, assert_bitwise_equal, seed_everything


def _train(mgr: safepoint.CheckpointManager, s: Setup, steps: range) -> None:
    for step in steps:
        s.step()
        mgr.maybe_save(step, s.state())


def test_round_trip_retention_and_release_leave_nothing_behind(store: Store) -> None:
    url = store.root()
    s = Setup()
    with safepoint.CheckpointManager(
        url, storage_options=store.options, save_every_steps=1, keep=safepoint.Keep(last=2)
    ) as mgr:
        assert mgr.restore(s.state()) == 0
        _train(mgr, s, range(1, 6))
        mgr.wait()  # retention's deletes run on the deleter thread
        assert [i.step for i in mgr.list()] == [4, 5]
        assert mgr.list()[-1].path == f"{url}/step-5", "the root as the user wrote it"
        assert ".lease" in store.keys(url), "the root is leased while the manager is open"
    keys = store.keys(url)
    assert {k.split("/")[0] for k in keys} == {"step-4", "step-5"}, f"old steps leaked: {keys}"
    snap = s.snapshot()
    seed_everything(7)
    s2 = Setup(seed=3)
    with safepoint.CheckpointManager(url, storage_options=store.options) as mgr:
        assert mgr.restore(s2.state()) == 5
    assert_bitwise_equal(snap, s2.snapshot())


@pytest.mark.slow
def test_tiered_upload_then_local_copy_lost(tmp_path: Path, store: Store) -> None:
    url, local = store.root(), tmp_path / "nvme"
    s = Setup()
    with safepoint.CheckpointManager(
        url, local_root=local, storage_options=store.options, save_every_steps=2, keep=safepoint.Keep(last=1)
    ) as mgr:
        _train(mgr, s, range(1, 5))
        mgr.wait()
        assert mgr.durability_lag().durable_step == 4
    assert RemoteLayout(url, store.options).committed_steps() == [4]
    assert {k.split("/")[0] for k in store.keys(url)} == {"step-4"}
    snap = s.snapshot()
    shutil.rmtree(local)
    s2 = Setup(seed=5)
    with safepoint.CheckpointManager(url, local_root=local, storage_options=store.options) as mgr:
        assert mgr.restore(s2.state()) == 4
    assert_bitwise_equal(snap, s2.snapshot())
    assert Layout(local).committed_steps() == [4]


@pytest.mark.slow
def test_corrupt_object_falls_back_to_the_previous_step(store: Store) -> None:
    url = store.root()
    s = Setup()
    with safepoint.CheckpointManager(url, storage_options=store.options, keep=safepoint.Keep(last=3)) as mgr:
        for step in (1, 2):
            s.step()
            mgr.save(step, s.state())
            if step == 1:
                snap = s.snapshot()
    fs, key = store.fs(), f"{url.split('://', 1)[1]}/step-2/__0_0.distcp"
    raw = bytearray(fs.cat_file(key))
    raw[len(raw) // 2] ^= 0xFF
    fs.pipe_file(key, bytes(raw))
    s2 = Setup(seed=5)
    with pytest.warns(safepoint.CheckpointWarning, match="step 2"):
        with safepoint.CheckpointManager(url, storage_options=store.options) as mgr:
            assert mgr.restore(s2.state()) == 1
    assert_bitwise_equal(snap, s2.snapshot())


def test_cli_ls_and_verify(
    store: Store, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from safepoint.cli import main as cli

    url = store.root()
    s = Setup()
    with safepoint.CheckpointManager(url, storage_options=store.options) as mgr:
        for step in (1, 2):
            s.step()
            mgr.save(step, s.state(), metrics={"loss": float(step)})
    fs, base = store.fs(), url.split("://", 1)[1]
    fs.pipe_file(f"{base}/step-3/__0_0.distcp", b"partial")  # an upload that never committed
    key = f"{base}/step-2/__0_0.distcp"
    raw = bytearray(fs.cat_file(key))
    raw[-1] ^= 1
    fs.pipe_file(key, bytes(raw))
    for k, v in store.env.items():  # the CLI takes endpoints and credentials from the environment
        monkeypatch.setenv(k, v)
    assert cli.main(["ls", url, "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert {s: (r["status"], r["tier"]) for s, r in rows.items()} == {
        1: ("ok", "durable"),
        2: ("ok", "durable"),
        3: ("partial", "durable"),
    }
    assert cli.main(["verify", url, "--all"]) == 1
    out = capsys.readouterr().out
    assert "ok      step 1" in out and "CORRUPT step 2: __0_0.distcp: crc32c" in out, out
    assert url in out and "abfs://" not in out, out


# ---- the lease --------------------------------------------------------------------------------------------


def test_second_writer_is_refused(store: Store) -> None:
    url = store.root()
    with safepoint.CheckpointManager(url, storage_options=store.options):
        with pytest.raises(safepoint.LeaseError, match="already held by another open CheckpointManager"):
            safepoint.CheckpointManager(url, storage_options=store.options)
        with pytest.raises(safepoint.LeaseError, match="in use by pid"):  # the lease refuses as well
            RemoteLayout(url, store.options).lease(120.0).acquire()
    with safepoint.CheckpointManager(url, storage_options=store.options):  # released on close
        pass


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_stale_lease_is_taken_over_and_leftovers_cleaned(
    other_store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A killed owner's lease (its pid gone on this host) is taken over, and its uncommitted objects go."""
    store = other_store
    url = store.root()
    s = Setup()
    with safepoint.CheckpointManager(url, storage_options=store.options) as mgr:
        s.step()
        mgr.save(1, s.state())
    fs, base = store.fs(), url.split("://", 1)[1]
    boot, pid_ns = namespace_identity()  # as every record safepoint writes: this pid can be asked here
    record = {"host": socket.gethostname(), "pid": _dead_pid(), "start_ticks": None, "token": "dead"}
    record |= {"boot_id": boot, "pid_ns": pid_ns}
    fs.pipe_file(f"{base}/.lease", json.dumps({**record, "heartbeat": time.time()}).encode())
    fs.pipe_file(f"{base}/step-2/__0_0.distcp", b"half an upload")  # the killed save's leftovers
    with safepoint.CheckpointManager(url, storage_options=store.options) as mgr:
        assert "took over the stale lease" in caplog.text
        assert mgr.restore(Setup(seed=2).state()) == 1
        assert not any(k.startswith("step-2/") for k in store.keys(url)), "the next owner cleans up"
        lease = json.loads(fs.cat_file(f"{base}/.lease"))
        assert lease["pid"] == os.getpid() and lease["token"] != "dead"
    assert ".lease" not in store.keys(url)


def test_a_stale_owner_is_fenced(other_store: Store) -> None:
    """After another host took the root over, the old owner neither commits nor deletes."""
    store = other_store
    url = store.root()
    fs, base = store.fs(), url.split("://", 1)[1]
    s = Setup()
    mgr = safepoint.CheckpointManager(url, storage_options=store.options, keep=safepoint.Keep(last=1))
    try:
        s.step()
        mgr.save(1, s.state())
        other = {"host": "elsewhere", "pid": 7, "heartbeat": time.time(), "token": "new-owner"}
        fs.pipe_file(f"{base}/.lease", json.dumps(other).encode())  # the takeover, as another host does it
        s.step()
        # Refused either at the commit fence (SaveError), or before writing anything (LeaseError) when the
        # lease was already seen lost: the run journal's copy to ROOT/.run/ checks it (tiers/journal_mirror.py).
        taken = (safepoint.SaveError, safepoint.LeaseError)
        with pytest.raises(taken, match="taken over by pid 7 on host 'elsewhere'"):
            mgr.save(2, s.state())
    finally:
        with contextlib.suppress(safepoint.CheckpointError):
            mgr.close()
    assert RemoteLayout(url, store.options).committed_steps() == [1], "step 1 kept, step 2 never committed"
    assert json.loads(fs.cat_file(f"{base}/.lease"))["token"] == "new-owner", "the new owner's lease stays"


def test_retention_deletes_a_manifest_once(gcs_endpoint: str) -> None:
    """Deleting a step sends its manifest's DELETE once (it used to go three times on GCS: deleted, then
    deleted again by the cleanup of the step's data, which gcsfs answers "not found", then key by key)."""
    from urllib.parse import unquote

    from tests.helpers.s3 import running_proxy
    from tests.helpers.stores import gcs_store

    store = gcs_store(gcs_endpoint)
    url = store.root()
    with running_proxy(store.endpoint) as proxy:
        via = Store(store.scheme, {}, {}, store.make_bucket, store.endpoint)
        opts = proxied_options(via, proxy.endpoint)
        with safepoint.CheckpointManager(
            url, storage_options=opts, save_every_steps=1, keep=safepoint.Keep(last=1)
        ) as mgr:
            _train(mgr, Setup(), range(1, 4))
    deletes = [unquote(p) for m, p, _ in proxy.seen if m == "DELETE" and "safepoint.json" in unquote(p)]
    assert len(deletes) == 2, deletes  # steps 1 and 2
