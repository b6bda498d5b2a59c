"""Incremental saves straight to a bucket (no ``local_root``): the unchanged stable groups of the previous
committed step are copied server-side (S3 CopyObject, GCS rewrite, Azure Copy Blob), never sent again
(remote/incremental_copy.py). What goes over the wire is counted by a loopback TCP proxy in front of the
real emulator (moto, fake-gcs-server, Azurite; tests/helpers/tcpproxy.py): every byte the client sends,
request lines and headers included. S3 runs in the default suite; GCS and Azure are slow."""

from __future__ import annotations

import json
import os
import posixpath
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import safepoint
from safepoint.remote.object_layout import RemoteLayout
from safepoint.remote.upload import MiB, TransferOptions
from safepoint.store.incremental import INCREMENTAL_KEY, is_stable_group
from safepoint.store.incremental_record import side_name
from tests.helpers.frozen_state import ADAPTER, BASE, Frozen, assert_restores_alone, saves_counted
from tests.helpers.stores import Store
from tests.helpers.tcpproxy import TcpProxy, proxied, tcp_proxy

CFG = TransferOptions(part_size=5 * MiB, concurrency=4)
# What a steady save may send besides the changed bytes: .metadata, the rank's fingerprint record, the
# manifest, the lease's heartbeat and the requests themselves (measured: ~30-60 KB; see docs/benchmarks.md).
OVERHEAD = 256 * 1024


def _saves(
    url: str, opts: dict[str, Any], model: Frozen, steps: range, proxy: TcpProxy, **kw: Any
) -> dict[int, int]:
    """Saves ``steps`` with a new manager (a new process's history); the bytes the client sent for each (an
    async save's write too)."""
    with safepoint.CheckpointManager(url, storage_options=opts, transfer=CFG, **kw) as mgr:
        return saves_counted(mgr, model, proxy, steps, wait=True)[0]


@pytest.mark.parametrize(
    "store",
    ["s3", pytest.param("gs", marks=pytest.mark.slow), pytest.param("az", marks=pytest.mark.slow)],
    indirect=True,
)
def test_a_steady_direct_save_copies_the_unchanged_bytes_server_side(tmp_path: Path, store: Store) -> None:
    url = store.root()
    with tcp_proxy(store.endpoint) as proxy:
        opts = proxied(store, proxy).options
        with safepoint.CheckpointManager(
            url, storage_options=opts, transfer=CFG, keep=safepoint.Keep(last=2)
        ) as mgr:
            up, saved = saves_counted(mgr, Frozen(), proxy)
    # Step 1 sends the base in the changing file, step 2 in a stable group; from step 3 on the group is
    # copied by the store: what goes up is the changed bytes and a small fixed overhead.
    assert up[1] > BASE and up[2] > BASE, up
    assert up[3] < ADAPTER * 4 + OVERHEAD and up[4] < ADAPTER * 4 + OVERHEAD, up
    layout = RemoteLayout(url, store.options, transfer=CFG)
    assert layout.committed_steps() == [3, 4]  # retention removed steps 1 and 2 (their objects) ...
    fs = store.fs()
    for step in (3, 4):
        manifest = layout.read_manifest(step)
        assert manifest.extra[INCREMENTAL_KEY]["linked"] > BASE, manifest.extra
        stable = [n for n in manifest.files if is_stable_group(n)]
        assert len(stable) == 1 and manifest.files[stable[0]].size > BASE, manifest.files
        layout.verify(step)  # ... and the copies steps 3 and 4 hold are intact, each an object of its own
        assert_restores_alone(fs, layout, step, saved[step], tmp_path)
    # Deleting step 3 leaves step 4 whole (server-side copies share nothing).
    layout.remove(3)
    layout.verify(4)
    fresh = Frozen()
    with safepoint.CheckpointManager(url, storage_options=store.options, transfer=CFG) as mgr:
        assert mgr.restore(safepoint.TrainState(model=fresh)) == 4
    assert torch.equal(fresh.base, saved[4]["base"]) and torch.equal(fresh.adapter, saved[4]["adapter"])


@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_a_new_process_copies_but_a_tampered_record_or_group_means_writing(store: Store) -> None:
    url = store.root()
    model = Frozen()
    fs = store.fs()
    layout = RemoteLayout(url, store.options, transfer=CFG)
    with tcp_proxy(store.endpoint) as proxy:
        opts = proxied(store, proxy).options
        assert min(_saves(url, opts, model, range(1, 3), proxy).values()) > BASE
        # A new manager (a restarted job) reads step 2's record back and copies at its first save.
        assert _saves(url, opts, model, range(3, 4), proxy)[3] < ADAPTER * 4 + OVERHEAD
        # The record of step 3 altered (same size, one fingerprint digit changed): it no longer matches
        # the crc32c the manifest lists, so nothing is taken from it and the next save writes everything.
        record = posixpath.join(layout.step_key(3), side_name(0))
        body = fs.cat_file(record)
        at = body.index(b'"fingerprints":[["') + 40
        fs.pipe_file(record, body[:at] + bytes([body[at] ^ 1]) + body[at + 1 :])
        assert fs.cat_file(record) != body
        up = _saves(url, opts, model, range(4, 6), proxy)
        assert up[4] > BASE and up[5] > BASE, up  # all written, then the base into a stable group anew
        # Step 5's stable group replaced by other bytes of the same size: S3's CRC32C of the copy does not
        # match the manifest, so the copy is dropped and the group is written from memory.
        group = next(n for n in layout.read_manifest(5).files if is_stable_group(n))
        key = posixpath.join(layout.step_key(5), group)
        data = bytearray(fs.cat_file(key))
        data[-100] ^= 0xFF
        fs.pipe_file(key, bytes(data))
        assert _saves(url, opts, model, range(6, 7), proxy)[6] > BASE
        assert _saves(url, opts, model, range(7, 8), proxy)[7] < ADAPTER * 4 + OVERHEAD
    for step in (6, 7):
        layout.verify(step)
        assert group not in store.keys(url + f"/step-{step}")  # no stray copy of the tampered group
        fresh = Frozen()
        with safepoint.CheckpointManager(url, storage_options=store.options, transfer=CFG) as mgr:
            assert mgr.restore(safepoint.TrainState(model=fresh), step=step) == step
        assert torch.equal(fresh.base, model.base) and torch.equal(fresh.adapter, model.adapter - 7 + step)


@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_every_full_every_th_direct_save_writes_everything(store: Store) -> None:
    url = store.root()
    with tcp_proxy(store.endpoint) as proxy:
        opts = proxied(store, proxy).options
        writer = safepoint.WriterOptions(full_every=3)
        up = _saves(url, opts, Frozen(), range(1, 8), proxy, writer=writer)
    big = [step for step, n in up.items() if n > BASE]
    # The first save and the second (the base into a stable group) send it; then every third save since
    # the last full copy is a physical full copy again (nothing copied server-side), the others copy.
    assert big == [1, 2, 4, 7], up
    layout = RemoteLayout(url, store.options, transfer=CFG)
    assert [json.loads(layout.manifest_bytes(s))["extra"][INCREMENTAL_KEY]["full"] for s in (4, 5)] == [
        True,
        False,
    ]


@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_an_async_direct_save_copies_too(store: Store) -> None:
    url = store.root()
    model = Frozen()
    with tcp_proxy(store.endpoint) as proxy:
        opts = proxied(store, proxy).options
        up = _saves(url, opts, model, range(1, 5), proxy, async_save=True)
    assert up[1] > BASE and up[2] > BASE and max(up[3], up[4]) < ADAPTER * 4 + OVERHEAD, up
    fresh = Frozen()
    with safepoint.CheckpointManager(url, storage_options=store.options, transfer=CFG) as mgr:
        assert mgr.restore(safepoint.TrainState(model=fresh)) == 4
    assert torch.equal(fresh.base, model.base) and torch.equal(fresh.adapter, model.adapter)


_CHILD = """
import json, os, signal, sys
import torch
import safepoint
import safepoint.remote.s3store as s3
from tests.remote.test_incremental_direct import CFG, Frozen

url, opts, when = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
model = Frozen()
state = safepoint.TrainState(model=model)
real = s3.S3Store.copy

def copy(self, src, dst, size=None, crc=None):
    if "step-3/" in dst and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    real(self, src, dst, size, crc)
    if "step-3/" in dst:
        os.kill(os.getpid(), signal.SIGKILL)  # the copy applied, nothing after it

with safepoint.CheckpointManager(url, storage_options=opts, transfer=CFG) as mgr:
    assert mgr.restore(state) == 2
    print(safepoint.__file__, flush=True)
    s3.S3Store.copy = copy
    with torch.no_grad():
        model.adapter.add_(1.0)
    mgr.save(3, state)
"""


@pytest.mark.parametrize("when", [pytest.param("before", marks=pytest.mark.slow), "after"])
@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_kill_9_during_the_server_side_copy_leaves_the_older_steps_and_no_step(
    store: Store, when: str
) -> None:
    """A real process SIGKILLed just before the store copies a stable group into the new step, or just
    after it did: steps 1 and 2 stay committed and whole, no step 3 is listed, and the next owner cleans up
    and saves (copying again)."""
    url = store.root()
    model = Frozen()
    with tcp_proxy(store.endpoint) as proxy:
        _saves(url, store.options, model, range(1, 3), proxy)
    src = str(Path(safepoint.__file__).parents[1])  # this tree's code in the child, not the venv's
    repo = str(Path(__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, repo])}
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, url, json.dumps(store.options), when],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert child.stdout.startswith(src), child.stdout
    layout = RemoteLayout(url, store.options, transfer=CFG)
    assert layout.committed_steps() == [1, 2]  # nothing of step 3 is committed ...
    for step in (1, 2):
        layout.verify(step)  # ... and the steps before are intact
    assert store.keys(url + "/step-3"), "the child had sent part of step 3"
    with tcp_proxy(store.endpoint) as proxy:  # the next owner: takes the dead child's lease, cleans up
        up = _saves(url, proxied(store, proxy).options, model, range(3, 4), proxy)
    assert up[3] < ADAPTER * 4 + OVERHEAD, up  # and copies (the record of step 2 is still good)
    assert layout.committed_steps() == [1, 2, 3]
    manifest = layout.verify(3)
    assert store.keys(url + "/step-3") == sorted([*manifest.files, "safepoint.json"])  # no leftovers
    fresh = Frozen()
    with safepoint.CheckpointManager(url, storage_options=store.options, transfer=CFG) as mgr:
        assert mgr.restore(safepoint.TrainState(model=fresh)) == 3
    assert torch.equal(fresh.base, model.base) and torch.equal(fresh.adapter, model.adapter)


def test_a_record_nested_too_deep_is_no_record() -> None:
    """A record (read back from a store or a disk) whose JSON nests past Python's recursion limit, with a
    manifest entry that matches it: no record (the next save writes everything), not a RecursionError."""
    import crc32c

    from safepoint.store.checksum import crc_hex
    from safepoint.store.incremental_record import decode
    from safepoint.store.manifest import FileEntry

    data = b"[" * 100_000 + b"]" * 100_000
    listed = {side_name(0): FileEntry(size=len(data), crc32c=crc_hex(crc32c.crc32c(data)))}
    assert decode(data, listed, 0, Path("bucket/run/step-1")) is None
