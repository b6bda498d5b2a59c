"""Incremental saves on GCS (fake-gcs-server) and Azure (Azurite), as test_incremental_upload.py does on
S3: a stable group the durable tier already holds is copied there server-side (GCS rewrite, Azure Copy
Blob), never uploaded again. What goes over the wire is counted by a loopback TCP proxy in front of the
emulator (tests/helpers/tcpproxy.py): the bytes of the real requests, not a mock of the store."""

from __future__ import annotations

import posixpath
from pathlib import Path

import crc32c
import pytest
import torch

import safepoint
from safepoint.remote.object_layout import RemoteLayout
from safepoint.remote.upload import MiB, TransferOptions
from safepoint.store.checksum import crc_hex
from safepoint.store.incremental import is_stable_group
from tests.helpers.frozen_state import BASE, Frozen, assert_restores_alone, saves_counted
from tests.helpers.stores import Store, azure_store
from tests.helpers.tcpproxy import proxied, tcp_proxy

CFG = TransferOptions(part_size=5 * MiB, concurrency=4)


def test_unchanged_files_are_copied_server_side_on_gcs_and_azure(tmp_path: Path, other_store: Store) -> None:
    url = other_store.root()
    with tcp_proxy(other_store.endpoint) as proxy:
        opts = proxied(other_store, proxy).options
        with safepoint.CheckpointManager(
            url, local_root=tmp_path / "l", storage_options=opts, transfer=CFG, keep=safepoint.Keep(last=2)
        ) as mgr:
            up, saved = saves_counted(mgr, Frozen(), proxy, wait=True)  # the upload counted with its step
    # Step 1 wrote the base, step 2 wrote it into a stable group (uploaded); from step 3 on the stable
    # group is linked locally and copied on the store: no byte of it goes up again.
    assert up[1] > BASE and up[2] > BASE, up
    assert up[3] < BASE // 4 and up[4] < BASE // 4, up
    layout = RemoteLayout(url, other_store.options, transfer=CFG)
    assert layout.committed_steps() == [3, 4]  # retention removed steps 1 and 2 ...
    fs = other_store.fs()
    for step in (3, 4):
        manifest = layout.read_manifest(step)
        stable = [n for n in manifest.files if is_stable_group(n)]
        assert stable and manifest.files[stable[0]].size > BASE, manifest.files
        _, crc = layout.store.stored_checksum(posixpath.join(layout.step_key(step), stable[0]))
        # GCS computes a crc32c of the copy (the copy is confirmed by it); Azure keeps none (by its
        # status and size: test_an_azure_copy_is_committed_only_once_the_store_reports_it_done).
        assert crc == (manifest.files[stable[0]].crc32c if other_store.scheme == "gs" else None)
        layout.verify(step)  # ... and the objects step 2 had, copied into steps 3 and 4, are intact
        assert_restores_alone(fs, layout, step, saved[step], tmp_path)
    # The newest step restores from the store itself.
    fresh = Frozen()
    with safepoint.CheckpointManager(url, storage_options=other_store.options, transfer=CFG) as mgr:
        assert mgr.restore(safepoint.TrainState(model=fresh)) == 4
    assert torch.equal(fresh.base, saved[4]["base"]) and torch.equal(fresh.adapter, saved[4]["adapter"])


# Azure answers a Copy Blob with its status; a copy may finish later ("pending") or fail. Azurite copies at
# once, so the proxy rewrites the status header Azurite sent into the other statuses Azure can send.
_SUCCESS = b"x-ms-copy-status: success"
_GROUP = "__0_1000000000000000000.distcp"


@pytest.mark.parametrize(("status", "times"), [(b"pending", 3), (b"aborted", -1)])
def test_an_azure_copy_is_committed_only_once_the_store_reports_it_done(
    tmp_path: Path, azurite_endpoint: str, status: bytes, times: int
) -> None:
    store = azure_store(azurite_endpoint)
    url = store.root()
    data = torch.randn(MiB // 4).numpy().tobytes()
    (tmp_path / _GROUP).write_bytes(data)
    entry = (_GROUP, len(data), crc_hex(crc32c.crc32c(data)))
    cfg = TransferOptions(part_size=5 * MiB, backoff_s=0.0, max_backoff_s=0.0, attempts=2)
    with tcp_proxy(store.endpoint) as proxy:
        layout = RemoteLayout(url, proxied(store, proxy).options, transfer=cfg)
        layout.put_files(layout.step_key(1), [(str(tmp_path / _GROUP), *entry)])
        proxy.corrupt_down, proxy.corrupt_down_times = (_SUCCESS, b"x-ms-copy-status: " + status), times
        if status == b"pending":  # polled until the store says success, then confirmed
            assert layout.copy_files(1, layout.step_key(2), [entry]) == []
            assert proxy.corrupted_down == times, "the copy's status was polled until it was done"
            assert store.fs().cat_file(posixpath.join(layout.step_key(2), _GROUP)) == data
        else:  # never taken as copied, after the retries: left to the caller to upload, no copy left
            assert layout.copy_files(1, layout.step_key(2), [entry]) == [_GROUP]
            assert not store.fs().exists(posixpath.join(layout.step_key(2), _GROUP))
