"""Where the requests a save no longer sends went (tests/remote/test_request_counts.py), each guarantee is
kept, on the real stores (moto, fake-gcs-server, Azurite) through a proxy that can alter their answers:

- the HEAD after a PUT: the PUT's answer carries the checksum the store computed, and one that differs
  from ours is refused (S3: ``answer_confirms``; GCS: the simple upload's answer, sent again);
- the commit's check of every object: what this process confirmed as it wrote it is not asked again
  (remote/confirmed.py), anything else is (another rank's object, one a foreign writer put there, one
  confirmed by an earlier attempt of the same save), so a wrong object still is never committed.
"""

from __future__ import annotations

import posixpath

import crc32c
import pytest

from safepoint.remote.object_layout import RemoteLayout
from safepoint.remote.open import open_store
from safepoint.remote.retry import TransferOptions, UploadError
from safepoint.remote.s3writer import open_writer
from safepoint.remote.upload import b64_crc
from safepoint.store.checksum import crc_hex
from safepoint.store.manifest import FileEntry, Manifest
from tests.helpers.stores import Store, gcs_store, s3_store
from tests.helpers.tcpproxy import proxied, tcp_proxy

DATA = b"checkpoint bytes " * 1000
CRC = crc_hex(crc32c.crc32c(DATA))
OTHER = b64_crc(f"{int(CRC, 16) ^ 1:08x}").encode()  # the same length in the answer: another crc32c
CFG = TransferOptions(backoff_s=0.0, max_backoff_s=0.0, attempts=2)


def test_an_s3_put_answered_with_another_crc32c_is_refused_without_a_head(moto_endpoint: str) -> None:
    store = s3_store(moto_endpoint)
    bucket = store.make_bucket()
    with tcp_proxy(store.endpoint) as proxy:
        s, base = open_store(f"s3://{bucket}/run", proxied(store, proxy).options, CFG)
        path = f"{base}/step-1/__0_0.distcp"
        proxy.corrupt_down, proxy.corrupt_down_times = (b64_crc(CRC).encode(), OTHER), 1
        writer = open_writer(s, path)
        writer.write(DATA)
        with pytest.raises(UploadError, match=f"the store reports crc32c [0-9a-f]+, expected {CRC}"):
            writer.close()
        assert proxy.corrupted_down == 1  # it was the PUT's answer that said so
        assert not s.confirmed.holds(path, len(DATA), CRC)
        writer = open_writer(s, path)  # answered truly: confirmed by the answer alone
        writer.write(DATA)
        writer.close()
        assert s.confirmed.holds(path, len(DATA), CRC)


def test_a_gcs_upload_answered_with_another_crc32c_is_sent_again(gcs_endpoint: str) -> None:
    store = gcs_store(gcs_endpoint)
    bucket = store.make_bucket()
    with tcp_proxy(store.endpoint) as proxy:
        s, base = open_store(f"gs://{bucket}/run", proxied(store, proxy).options, CFG)
        path = f"{base}/step-1/rank-0.state"
        proxy.corrupt_down, proxy.corrupt_down_times = (b64_crc(CRC).encode(), OTHER), 1
        s.put_bytes(path, DATA)
        assert proxy.corrupted_down == 1 and s.confirmed.holds(path, len(DATA), CRC)
        proxy.corrupt_down_times = -1  # every answer wrong: refused, never taken as stored
        with pytest.raises(UploadError, match="after 2 attempts"):
            s.put_bytes(path, DATA)
        assert not s.confirmed.holds(path, len(DATA), CRC)


def _manifest(step: int, **files: bytes) -> Manifest:
    entries = {n: FileEntry(size=len(b), crc32c=crc_hex(crc32c.crc32c(b))) for n, b in files.items()}
    return Manifest(step=step, files=entries)


def test_the_commit_asks_the_store_about_every_object_this_process_did_not_confirm(store: Store) -> None:
    url = store.root()
    layout = RemoteLayout(url, store.options, transfer=CFG)
    foreign = store.fs()  # another rank, or any other writer: nothing it wrote was confirmed here
    pending = layout.new_pending(7, "a")
    layout.store.put_bytes(posixpath.join(pending, "ours"), DATA)
    foreign.pipe_file(posixpath.join(pending, "theirs"), DATA[:-1])  # not what the manifest lists
    with pytest.raises(UploadError, match=r"theirs cannot be committed: size 16999 != 17000"):
        layout.commit(pending, _manifest(7, ours=DATA, theirs=DATA))
    foreign.pipe_file(posixpath.join(pending, "theirs"), DATA)
    layout.commit(pending, _manifest(7, ours=DATA, theirs=DATA))
    assert layout.committed_steps() == [7]


def test_a_retried_save_does_not_count_what_an_earlier_attempt_confirmed(store: Store) -> None:
    url = store.root()
    layout = RemoteLayout(url, store.options, transfer=CFG)
    pending = layout.new_pending(8, "a")
    ours = posixpath.join(pending, "ours")
    layout.store.put_bytes(ours, DATA)  # the first attempt failed after this (not committed) ...
    assert layout.store.confirmed.holds(ours, len(DATA), crc_hex(crc32c.crc32c(DATA)))
    store.fs().pipe_file(ours, DATA[:-1])  # ... and the object changed before the retry
    assert layout.new_pending(8, "b") == pending  # the retry writes in place again
    with pytest.raises(UploadError, match=r"ours cannot be committed: size 16999 != 17000"):
        layout.commit(pending, _manifest(8, ours=DATA))
    assert layout.committed_steps() == []


def test_a_gcs_read_that_fails_mid_restore_falls_back_to_the_older_step(gcs_endpoint: str) -> None:
    """GCS reads go through GcsStore's own reader (one stat, ranged reads): a read the store keeps failing
    is an OSError, as a file's is, so the restore warns and takes the older step, never a traceback."""
    import torch
    from torch import nn

    import safepoint
    from tests.helpers.s3 import running_proxy
    from tests.helpers.tcpproxy import proxied_options

    store = gcs_store(gcs_endpoint)
    url = store.root()
    model = nn.Linear(8, 8)
    cfg = TransferOptions(backoff_s=0.0, max_backoff_s=0.0, attempts=2, client_retries=0)
    with safepoint.CheckpointManager(url, storage_options=store.options, transfer=cfg) as mgr:
        for step in (1, 2):
            with torch.no_grad():
                model.weight.fill_(float(step))
            mgr.save(step, safepoint.TrainState(model=model))
    with running_proxy(store.endpoint) as proxy:
        proxy.add("503", method="GET", path=r"^/download/.*step-2%2F__0_0\.distcp")
        fresh = nn.Linear(8, 8)
        opts = proxied_options(store, proxy.endpoint)
        with safepoint.CheckpointManager(url, storage_options=opts, transfer=cfg) as mgr:
            assert mgr.restore(safepoint.TrainState(model=fresh)) == 1
        assert proxy.faults() == 2  # both attempts of the read, then the older step
    assert torch.equal(fresh.weight, torch.full((8, 8), 1.0))
