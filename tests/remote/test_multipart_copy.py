"""S3's server-side copy of an object over CopyObject's 5 GiB limit (remote/s3copy.py): UploadPartCopy parts
of an upload made with a full-object CRC32C, so that the copy is proven equal to its source without a read.

Before, such a copy went through s3fs's managed copy (no checksum algorithm): the copy had no CRC32C, its
check went by the size alone, and an incremental save listed a copy of other bytes than the manifest's.
These tests shrink the 5 GiB limit (and the parts) so that a few MiB on moto take that path; s3fs's own
threshold is shrunk too, so that the code before the fix took the path it took for > 5 GiB.
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

import safepoint
from safepoint.remote import s3copy, s3store
from safepoint.remote.object_layout import RemoteLayout
from safepoint.remote.s3store import S3Store
from safepoint.remote.upload import FileCopy, MiB, TransferOptions, UploadError, b64_crc
from safepoint.store.checksum import crc_hex
from safepoint.store.incremental import is_stable_group
from tests.helpers.frozen_state import ADAPTER, BASE, Frozen, saves_counted
from tests.helpers.s3 import FaultProxy, storage_options
from tests.helpers.stores import Store
from tests.helpers.tcpproxy import proxied, tcp_proxy

CFG = TransferOptions(part_size=5 * MiB, concurrency=4)
OVERHEAD = 256 * 1024  # as in test_incremental_direct.py


@pytest.fixture
def small_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Objects over 1 MiB are "over 5 GiB", copied in parts of 5 MiB (moto's minimum but for the last)."""
    import s3fs

    monkeypatch.setattr(s3store, "_MAX_COPY", 1 * MiB)
    monkeypatch.setattr(s3copy, "COPY_PART", 5 * MiB)
    monkeypatch.setattr(s3fs.core, "MANAGED_COPY_THRESHOLD", 1 * MiB)


def _recorded(
    store: S3Store, monkeypatch: pytest.MonkeyPatch, args: dict[str, dict[str, Any]] | None = None
) -> list[str]:
    """The S3 requests ``store`` makes from here on (their names, and into ``args`` the last arguments of
    each; the requests themselves go to moto)."""
    calls: list[str] = []
    real = store.call

    async def call(method: str, **kw: Any) -> Any:
        calls.append(method)
        if args is not None:
            args[method] = kw
        return await real(method, **kw)

    monkeypatch.setattr(store, "call", call)
    return calls


def test_a_copy_over_the_copy_limit_is_proven_by_its_full_object_crc32c(
    moto_endpoint: str, bucket: str, small_limit: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    store = S3Store(s3fs.S3FileSystem(**storage_options(moto_endpoint), skip_instance_cache=True), CFG)
    data = os.urandom(11 * MiB + 3)
    crc, src, dst = crc_hex(crc32c.crc32c(data)), f"{bucket}/a/big.bin", f"{bucket}/b/big.bin"
    store.put_bytes(src, data)
    args: dict[str, dict[str, Any]] = {}
    calls = _recorded(store, monkeypatch, args)
    store.copy(src, dst, len(data), crc)
    assert calls.count("upload_part_copy") == 3 and "copy_object" not in calls, calls  # 5 + 5 + 1 MiB
    # Completed with the manifest's crc32c as the full-object CRC32C: S3 itself refuses a copy of other
    # bytes at completion (moto does not check it; the comparison below does).
    done = args["complete_multipart_upload"]
    assert (done["ChecksumType"], done["ChecksumCRC32C"]) == ("FULL_OBJECT", b64_crc(crc)), done
    # The copy carries S3's full-object CRC32C of the bytes it copied: check() proves it without a read ...
    assert store.stored_checksum(dst) == (len(data), crc)
    assert store.check(dst, len(data), crc, read=False) is None
    # ... and refuses it against another crc32c (the source's manifest entry, had the source changed).
    assert store.check(dst, len(data), crc_hex(crc32c.crc32c(b"other")), read=False) is not None
    assert store.get_bytes(dst) == data
    assert not store.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")
    # Up to the limit CopyObject still copies (one request).
    calls.clear()
    store.copy(src, f"{bucket}/c/big.bin", 1 * MiB)
    assert calls == ["copy_object"], calls


def test_a_failed_part_copy_aborts_the_upload(moto_endpoint: str, bucket: str, small_limit: None) -> None:
    import s3fs

    store = S3Store(s3fs.S3FileSystem(**storage_options(moto_endpoint), skip_instance_cache=True), CFG)
    dst = f"{bucket}/b/big.bin"
    # A source shorter than the size given: the last part's range lies past its end and S3 refuses it.
    store.put_bytes(f"{bucket}/a/big.bin", os.urandom(6 * MiB))
    with pytest.raises(UploadError):
        store.copy(f"{bucket}/a/big.bin", dst, 12 * MiB)
    assert not store.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")
    assert not store.fs.exists(dst)


@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_an_incremental_save_never_lists_a_multipart_copy_of_other_bytes(
    store: Store, small_limit: None
) -> None:
    """Steady saves copy the 4 MiB stable group in parts (no client bytes); a group replaced by other
    bytes of the same size makes a copy whose CRC32C is not the manifest's: it is dropped and written."""
    url = store.root()
    model = Frozen()
    layout = RemoteLayout(url, store.options, transfer=CFG)
    fs = store.fs()
    with tcp_proxy(store.endpoint) as proxy:
        opts = proxied(store, proxy).options
        with safepoint.CheckpointManager(url, storage_options=opts, transfer=CFG) as mgr:
            up = saves_counted(mgr, model, proxy, range(1, 4), wait=True)[0]
        assert up[1] > BASE and up[2] > BASE and up[3] < ADAPTER * 4 + OVERHEAD, up
        group = next(n for n in layout.read_manifest(3).files if is_stable_group(n))
        entry = layout.read_manifest(3).files[group]
        key = posixpath.join(layout.step_key(3), group)
        assert S3Store(fs, CFG).stored_checksum(key) == (entry.size, entry.crc32c)
        data = bytearray(fs.cat_file(key))
        data[-100] ^= 0xFF
        fs.pipe_file(key, bytes(data))
        with safepoint.CheckpointManager(url, storage_options=opts, transfer=CFG) as mgr:
            up = saves_counted(mgr, model, proxy, range(4, 6), wait=True)[0]
    assert up[4] > BASE and up[5] < ADAPTER * 4 + OVERHEAD, up
    for step in (4, 5):
        layout.verify(step)
        fresh = Frozen()
        with safepoint.CheckpointManager(url, storage_options=store.options, transfer=CFG) as mgr:
            assert mgr.restore(safepoint.TrainState(model=fresh), step=step) == step
        assert torch.equal(fresh.base, model.base)


def test_a_part_copy_without_a_full_object_crc32c_is_deleted_and_refused(
    moto_endpoint: str, bucket: str, small_limit: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that ignores the full-object request (here: the upload created COMPOSITE, so moto keeps a
    composite CRC32C, which proves no file crc32c without the parts) leaves no unproven copy behind."""
    import s3fs

    store = S3Store(s3fs.S3FileSystem(**storage_options(moto_endpoint), skip_instance_cache=True), CFG)
    data = os.urandom(6 * MiB)
    store.put_bytes(f"{bucket}/a/big.bin", data)
    create = store.create_mpu

    async def composite_upload(bucket: str, key: str, what: str, *, full: bool) -> str:
        return await create(bucket, key, what, full=False)

    monkeypatch.setattr(store, "create_mpu", composite_upload)
    with pytest.raises(UploadError, match="no full-object CRC32C"):
        store.copy(f"{bucket}/a/big.bin", f"{bucket}/b/big.bin", len(data))
    assert not store.fs.exists(f"{bucket}/b/big.bin")


def test_a_part_copy_whose_completion_answer_was_lost_is_confirmed_not_refused(
    proxy: FaultProxy, bucket: str, small_limit: None
) -> None:
    """The completion of the multipart copy is applied by the store and its answer lost (the proxy resets
    the connection); the retry is answered NoSuchUpload, as S3 may answer it, the upload being gone because
    it completed. The copy goes through the store's one completion path (complete_mpu), which knows that
    case, and is confirmed by a HEAD: the full-object CRC32C S3 computed of it.

    Before, s3copy.py completed with its own request: the NoSuchUpload failed the copy, which was then
    deleted and its group written again (safe, but every byte of a > 5 GiB group sent for nothing)."""
    import s3fs

    cfg = TransferOptions(part_size=5 * MiB, concurrency=4, backoff_s=0.0, max_backoff_s=0.0)
    fs = s3fs.S3FileSystem(**storage_options(proxy.endpoint), skip_instance_cache=True)
    store = S3Store(fs, cfg)
    data = os.urandom(11 * MiB + 3)
    crc, src, dst = crc_hex(crc32c.crc32c(data)), f"{bucket}/a/big.bin", f"{bucket}/b/big.bin"
    store.put_bytes(src, data)
    complete = r"/b/big\.bin\?uploadId="
    lost = proxy.add("lost", method="POST", path=complete, count=1)
    gone = proxy.add("NoSuchUpload", method="POST", path=complete, count=1)
    store.copy(src, dst, len(data), crc)
    assert (lost.hits, gone.hits) == (1, 1)
    assert [w for m, p, w in proxy.seen if m == "POST" and "uploadId=" in p] == ["lost", "NoSuchUpload"]
    assert store.check(dst, len(data), crc, read=False) is None  # the store's full-object CRC32C
    assert store.get_bytes(dst) == data
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")


def test_an_upload_whose_completion_answer_was_lost_is_confirmed_not_refused(
    proxy: FaultProxy, bucket: str, tmp_path: Path
) -> None:
    """The same lost answer for a multipart upload of a local file (the same completion path). botocore
    retries a reset connection itself, inside safepoint's first attempt: complete_mpu used to accept the
    NoSuchUpload only on its own second attempt, and failed the upload here."""
    import s3fs

    cfg = TransferOptions(part_size=5 * MiB, concurrency=4, backoff_s=0.0, max_backoff_s=0.0)
    fs = s3fs.S3FileSystem(**storage_options(proxy.endpoint), skip_instance_cache=True)
    data = os.urandom(11 * MiB + 3)
    (tmp_path / "big.bin").write_bytes(data)
    crc = crc_hex(crc32c.crc32c(data))
    complete = r"/up/big\.bin\?uploadId="
    proxy.add("lost", method="POST", path=complete, count=1)
    proxy.add("NoSuchUpload", method="POST", path=complete, count=1)
    S3Store(fs, cfg).put_files([FileCopy(str(tmp_path / "big.bin"), f"{bucket}/up/big.bin", len(data), crc)])
    assert [w for m, p, w in proxy.seen if m == "POST" and "uploadId=" in p] == ["lost", "NoSuchUpload"]
    assert fs.cat_file(f"{bucket}/up/big.bin") == data
