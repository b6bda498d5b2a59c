"""A lost answer on an S3-compatible store that keeps no CRC32C: the object at the key is proven by its
ETag (the MD5 of the body sent; for a multipart upload the MD5 of the parts' binary MD5s, "-<parts>"),
else read back: never taken by its size.

The store is moto behind two proxies: a fault proxy (tests/helpers/s3.py) that applies a request and loses
its answer, then answers the retry ``NoSuchUpload`` as S3 may (the upload is gone because it completed),
and in front of it a TCP proxy that hides every CRC32C moto reports (tests/helpers/tcpproxy.py). Between
the lost answer and the HEAD that follows it, another writer puts an object of the same size at the key.

Before, the HEAD found no CRC32C and accepted that object by its size: the manifest would have listed a
file whose bytes are not the ones sent (caught only at load).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import pytest

from safepoint.remote.s3store import S3Store
from safepoint.remote.s3writer import open_writer
from safepoint.remote.upload import FileCopy, MiB, StreamWriteError, TransferOptions, UploadError
from safepoint.store.checksum import crc_hex
from tests.helpers.s3 import FaultProxy, storage_options
from tests.helpers.tcpproxy import TcpProxy, hide_crc32c, tcp_proxy

CFG = TransferOptions(part_size=5 * MiB, concurrency=4, attempts=3, backoff_s=0.0, max_backoff_s=0.0)
_COMPLETE = r"/obj\.bin\?uploadId="


@pytest.fixture
def chain(proxy: FaultProxy) -> Iterator[tuple[S3Store, TcpProxy]]:
    """(an S3Store reaching moto through the CRC32C-hiding proxy and the fault proxy, the former)."""
    import s3fs  # here, not at the top: every xdist worker imports this module (tests/test_architecture.py)

    with tcp_proxy(proxy.endpoint) as hiding:
        hide_crc32c(hiding)
        fs = s3fs.S3FileSystem(**storage_options(hiding.endpoint), skip_instance_cache=True)
        yield S3Store(fs, CFG), hiding


def _foreign_at_head(
    store: S3Store, monkeypatch: pytest.MonkeyPatch, moto: str, path: str, other: bytes, times: int = 1
) -> list[int]:
    """Another writer (straight to moto, not through the proxies) puts ``other`` at ``path`` just before
    each of the store's next ``times`` HEADs of it. [HEADs still to alter, ranged GETs the store made]."""
    import boto3

    client = boto3.client("s3", endpoint_url=moto, region_name="us-east-1")
    bucket, key = path.split("/", 1)
    seen = [times, 0]
    real = store.call

    async def call(method: str, **kw: Any) -> Any:
        if method == "head_object" and seen[0] > 0 and kw["Key"] == key:
            seen[0] -= 1
            await asyncio.to_thread(client.put_object, Bucket=bucket, Key=key, Body=other)
        if method == "get_object":
            seen[1] += 1
        return await real(method, **kw)

    monkeypatch.setattr(store, "call", call)
    return seen


def _upload(store: S3Store, tmp_path: Path, path: str, data: bytes) -> None:
    (tmp_path / "obj.bin").write_bytes(data)
    store.put_files([FileCopy(str(tmp_path / "obj.bin"), path, len(data), crc_hex(crc32c.crc32c(data)))])


def _other(data: bytes) -> bytes:
    other = bytearray(data)
    other[-100] ^= 0xFF  # the same size: a check by size cannot tell
    return bytes(other)


def test_a_lost_completion_with_another_object_at_the_key_is_uploaded_again(
    chain: tuple[S3Store, TcpProxy],
    proxy: FaultProxy,
    moto_endpoint: str,
    bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The completion is applied and its answer lost; another object of the same size stands at the key
    when the HEAD comes. Its ETag is not the one the parts sent make: it is read back, refused, and the
    file uploaded again (then proven by its ETag, nothing read)."""
    store, _ = chain
    data = os.urandom(6 * MiB + 3)  # 2 parts
    path = f"{bucket}/obj.bin"
    proxy.add("lost", method="POST", path=_COMPLETE, count=1)
    proxy.add("NoSuchUpload", method="POST", path=_COMPLETE, count=1)
    reads = _foreign_at_head(store, monkeypatch, moto_endpoint, path, _other(data))
    _upload(store, tmp_path, path, data)
    assert [w for m, p, w in proxy.seen if m == "POST" and "uploadId=" in p][:2] == ["lost", "NoSuchUpload"]
    assert reads == [0, 2]  # the other object read back once (2 ranges), then nothing
    assert store.fs.cat_file(path) == data
    crc = crc_hex(crc32c.crc32c(data))
    assert store.versions.tag(path, len(data), crc) == store.fs.info(path, refresh=True)["ETag"]


def test_a_lost_completion_of_our_own_bytes_is_proven_by_the_multipart_etag(
    chain: tuple[S3Store, TcpProxy],
    proxy: FaultProxy,
    moto_endpoint: str,
    bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same lost answer with nobody else writing: the HEAD's ETag is the MD5 of the parts' MD5s,
    "-2" (moto follows S3's rule), so the upload is proven without a byte read back."""
    store, _ = chain
    data = os.urandom(6 * MiB + 3)
    path = f"{bucket}/obj.bin"
    proxy.add("lost", method="POST", path=_COMPLETE, count=1)
    proxy.add("NoSuchUpload", method="POST", path=_COMPLETE, count=1)
    reads = _foreign_at_head(store, monkeypatch, moto_endpoint, path, b"", times=0)
    _upload(store, tmp_path, path, data)
    assert [w for m, p, w in proxy.seen if m == "POST" and "uploadId=" in p] == ["lost", "NoSuchUpload"]
    assert reads == [0, 0]
    tag = store.fs.info(path, refresh=True)["ETag"]
    assert tag.endswith('-2"'), tag
    assert store.versions.tag(path, len(data), crc_hex(crc32c.crc32c(data))) == tag


def test_an_upload_that_never_proves_itself_fails_in_one_line(
    chain: tuple[S3Store, TcpProxy],
    moto_endpoint: str,
    bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another object at the key after every attempt (one PUT each: a file under one part): the upload
    fails after its attempts with one line, and nothing is remembered as proven."""
    store, _ = chain
    data = os.urandom(MiB)
    path = f"{bucket}/obj.bin"
    _foreign_at_head(store, monkeypatch, moto_endpoint, path, _other(data), times=CFG.attempts)
    with pytest.raises(UploadError, match="failed after 3 attempts.*DamagedInTransit") as e:
        _upload(store, tmp_path, path, data)
    assert "\n" not in str(e.value)
    assert store.versions.tag(path, len(data), crc_hex(crc32c.crc32c(data))) is None


def test_a_streamed_put_whose_answer_was_lost_is_not_taken_by_its_size(
    chain: tuple[S3Store, TcpProxy],
    proxy: FaultProxy,
    moto_endpoint: str,
    bucket: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DCP's stream straight to S3 (S3Writer), a file under one part: one PUT, its answer lost and the
    PUT sent again, and another object of the same size at the key before the HEAD. Streamed, there is
    nothing to send again from: the write fails (the save is not committed)."""
    store, _ = chain
    data = os.urandom(MiB)
    path = f"{bucket}/obj.bin"
    proxy.add("lost", method="PUT", path=r"/obj\.bin($|\?x-id=PutObject)", count=1)
    _foreign_at_head(store, monkeypatch, moto_endpoint, path, _other(data))
    writer = open_writer(store, path)
    writer.write(data)
    with pytest.raises(StreamWriteError, match="crc32c") as e:
        writer.close()
    assert "\n" not in str(e.value)
    assert [w for m, p, w in proxy.seen if m == "PUT"][:2] == ["lost", "forward"]
