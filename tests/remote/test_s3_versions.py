"""An S3-compatible store that keeps no CRC32C (older MinIO, Ceph RGW, R2, appliances; played by moto behind
a proxy that hides every CRC32C it reports) proves a server-side copy by the source's version, as
Azure does (remote/versions.py): a version this process wrote or read back under one ETag is copied on the
condition ``CopySourceIfMatch`` = that ETag, and the copy's own ETag is remembered in turn, so a steady save
reads nothing back. Before this, every copied group was downloaded again at every save.

moto (5.2) ignores ``x-amz-copy-source-if-match`` on CopyObject and UploadPartCopy: these tests show the
condition is sent with the proven ETag, and that a source altered in place is still refused (by the HEAD
after the copy, s3read.py ``unchanged``, then the read back); S3's own 412 is untested here.
"""

from __future__ import annotations

import asyncio
import os
import posixpath
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

import safepoint
from safepoint.remote import s3copy, s3store
from safepoint.remote.object_layout import RemoteLayout
from safepoint.remote.upload import MiB, TransferOptions, UploadError
from safepoint.store.checksum import crc_hex
from safepoint.store.incremental import is_stable_group
from tests.helpers.frozen_state import ADAPTER, BASE, Frozen, saves_counted
from tests.helpers.stores import Store, s3_store
from tests.helpers.tcpproxy import TcpProxy, hide_crc32c, proxied, tcp_proxy

CFG = TransferOptions(part_size=5 * MiB, concurrency=4)
OVERHEAD = 256 * 1024  # as in test_incremental_direct.py
NOTHING = 64 * 1024  # "no bytes read back": HEADs, listings and small answers only
_SMALL, _BIG = "__0_1000000000000000000.distcp", "__0_1000000000000000001.distcp"


@pytest.fixture
def no_crc(moto_endpoint: str) -> Iterator[tuple[Store, Store, TcpProxy]]:
    """(moto as safepoint reaches it, through a proxy that hides every CRC32C moto reports: the headers, the
    checksum type, and the XML elements of a completion's or copy's answer; moto reached directly; the
    proxy)."""
    raw = s3_store(moto_endpoint)
    with tcp_proxy(raw.endpoint) as proxy:
        hide_crc32c(proxy)
        yield proxied(raw, proxy), raw, proxy


def _recorded(layout: RemoteLayout, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """The S3 requests ``layout``'s store makes from here on, with their arguments (they still go to moto)."""
    calls: list[tuple[str, dict[str, Any]]] = []
    store = layout.store
    real = store.call  # type: ignore[attr-defined]

    async def call(method: str, **kw: Any) -> Any:
        calls.append((method, kw))
        return await real(method, **kw)

    monkeypatch.setattr(store, "call", call)
    return calls


def _alter_in_place(raw: Store, key: str) -> None:
    fs = raw.fs()
    data = bytearray(fs.cat_file(key))
    data[-100] ^= 0xFF
    fs.pipe_file(key, bytes(data))


def _etag(raw: Store, key: str) -> str:
    return str(raw.fs().info(key, refresh=True)["ETag"])


def test_a_copy_from_a_version_this_process_proved_reads_nothing_back(
    tmp_path: Path, no_crc: tuple[Store, Store, TcpProxy], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A single-PUT group and a multipart one, uploaded (tiered), copied step to step with no read; the
    copies carry ``CopySourceIfMatch`` = the ETag written; a source altered in place is refused and its copy
    deleted; a new process reads each group back once, then knows the copy it proved."""
    store, raw, proxy = no_crc
    url = store.root()
    layout = RemoteLayout(url, store.options, transfer=CFG)
    key = layout.step_key
    blobs = {_SMALL: os.urandom(MiB // 2), _BIG: os.urandom(6 * MiB + 7)}  # a PUT; 2 parts of an upload
    entries = [(n, len(d), crc_hex(crc32c.crc32c(d))) for n, d in blobs.items()]
    for name, data in blobs.items():
        (tmp_path / name).write_bytes(data)
    layout.put_files(key(1), [(str(tmp_path / n), n, size, crc) for n, size, crc in entries])

    def copied(layout: RemoteLayout, src: int, dst: int) -> tuple[list[str], int]:
        proxy.reset_counts()
        return sorted(layout.copy_files(src, key(dst), entries)), proxy.down

    calls = _recorded(layout, monkeypatch)
    assert copied(layout, 1, 2) == ([], pytest.approx(0, abs=NOTHING))  # from what it wrote
    conds = {c["Key"].rsplit("/", 1)[1]: c.get("CopySourceIfMatch") for m, c in calls if m == "copy_object"}
    assert conds == {n: _etag(raw, posixpath.join(key(1), n)) for n in blobs}, conds
    assert not [m for m, _ in calls if m == "get_object"], calls
    assert copied(layout, 2, 3) == ([], pytest.approx(0, abs=NOTHING))  # from what it copied
    _alter_in_place(raw, posixpath.join(key(3), _SMALL))
    assert copied(layout, 3, 4)[0] == [_SMALL]  # refused (moto ignores the condition: read back)
    assert not raw.fs().exists(posixpath.join(key(4), _SMALL))
    fresh = RemoteLayout(url, store.options, transfer=CFG)  # a new process: nothing proven yet
    failed, down = copied(fresh, 2, 5)
    assert failed == [] and down > sum(map(len, blobs.values()))  # read back once ...
    assert copied(fresh, 5, 6) == ([], pytest.approx(0, abs=NOTHING))  # ... then known
    assert copied(fresh, 3, 7)[0] == [_SMALL]  # and the altered one is found by reading it
    for step in (2, 5, 6):
        for name, data in blobs.items():
            assert raw.fs().cat_file(posixpath.join(key(step), name)) == data, (step, name)


def test_a_multipart_copy_of_a_proven_version_is_conditional_on_every_part(
    tmp_path: Path,
    no_crc: tuple[Store, Store, TcpProxy],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over CopyObject's limit (1 MiB here) a store without CRC32C gives the copy no full-object CRC32C:
    a copy of an unproven version is refused (the group is written), one of a proven version is made of
    UploadPartCopy parts each on the condition ``CopySourceIfMatch`` and taken without a read."""
    import s3fs  # here, not at the top: every xdist worker imports this module (tests/test_architecture.py)

    monkeypatch.setattr(s3store, "_MAX_COPY", 1 * MiB)
    monkeypatch.setattr(s3copy, "COPY_PART", 5 * MiB)
    monkeypatch.setattr(s3fs.core, "MANAGED_COPY_THRESHOLD", 1 * MiB)
    store, raw, proxy = no_crc
    url = store.root()
    layout = RemoteLayout(url, store.options, transfer=CFG)
    key = layout.step_key
    data = os.urandom(11 * MiB + 3)
    entry = (_BIG, len(data), crc_hex(crc32c.crc32c(data)))
    (tmp_path / _BIG).write_bytes(data)
    layout.put_files(key(1), [(str(tmp_path / _BIG), *entry)])
    calls = _recorded(layout, monkeypatch)
    proxy.reset_counts()
    assert layout.copy_files(1, key(2), [entry]) == [] and proxy.down < NOTHING
    parts = [c for m, c in calls if m == "upload_part_copy"]
    assert len(parts) == 3 and "copy_object" not in [m for m, _ in calls], calls  # 5 + 5 + 1 MiB
    assert {p["CopySourceIfMatch"] for p in parts} == {_etag(raw, posixpath.join(key(1), _BIG))}
    proxy.reset_counts()
    assert layout.copy_files(2, key(3), [entry]) == [] and proxy.down < NOTHING  # from its own copy
    fresh = RemoteLayout(url, store.options, transfer=CFG)  # nothing proven: no proof of a big copy
    assert fresh.copy_files(2, key(4), [entry]) == [_BIG]
    for step in (2, 3):
        assert raw.fs().cat_file(posixpath.join(key(step), _BIG)) == data


def test_steady_direct_saves_read_nothing_back_and_an_altered_group_is_written(
    no_crc: tuple[Store, Store, TcpProxy],
) -> None:
    """Straight to the bucket (S3Writer): the steady saves copy the stable group with no read; once it is
    altered in place at the same size, the next save of the same manager writes it again, and that step
    restores bit for bit."""
    store, raw, proxy = no_crc
    url = store.root()
    model = Frozen()
    layout = RemoteLayout(url, raw.options, transfer=CFG)
    with safepoint.CheckpointManager(url, storage_options=store.options, transfer=CFG) as mgr:
        up, saved = saves_counted(mgr, model, proxy, range(1, 4), wait=True)
        assert proxy.down < NOTHING, proxy.down  # step 3's copy: nothing read back
        assert up[3] < ADAPTER * 4 + OVERHEAD, up
        group = next(n for n in layout.read_manifest(3).files if is_stable_group(n))
        _alter_in_place(raw, posixpath.join(layout.step_key(3), group))
        up, more = saves_counted(mgr, model, proxy, range(4, 5), wait=True)
        assert up[4] > BASE, up  # written again, not copied from the altered group
    layout.verify(4)
    fresh = Frozen()
    with safepoint.CheckpointManager(url, storage_options=raw.options, transfer=CFG) as mgr:
        assert mgr.restore(safepoint.TrainState(model=fresh), step=4) == 4
    assert torch.equal(fresh.base, more[4]["base"]) and torch.equal(fresh.adapter, more[4]["adapter"])
    assert torch.equal(fresh.base, saved[1]["base"])


def test_an_upload_damaged_on_the_way_in_is_sent_again_never_taken_by_its_size(
    tmp_path: Path, no_crc: tuple[Store, Store, TcpProxy]
) -> None:
    """moto keeps a PUT's (and a part's) CRC32C without checking it, and the proxy hides it: bytes damaged
    on the way in are stored. Their ETag is not the one the bytes sent make (their MD5s), so the upload is
    not proven: the object is read back, its crc32c differs, and the file is sent again, every attempt,
    until the upload fails (UploadError, one line): never confirmed by its size, no version remembered.
    Once the link is sound again the same upload is proven by its ETag, with no read back.

    Before, the damaged objects were taken as uploaded (confirmed by size) and found only at load."""
    store, raw, proxy = no_crc
    cfg = TransferOptions(part_size=5 * MiB, concurrency=4, attempts=2, backoff_s=0.0, max_backoff_s=0.0)
    layout = RemoteLayout(store.root(), store.options, transfer=cfg)
    key = layout.step_key
    marker = b"safepoint-marker"  # in every kilobyte: every chunk the proxy forwards has one to alter
    body = (marker + os.urandom(1008)) * (6 * MiB // 1024 + 1)
    blobs = {_SMALL: body[: MiB // 2], _BIG: body}  # a PUT; 2 parts of an upload
    entries = [(n, len(d), crc_hex(crc32c.crc32c(d))) for n, d in blobs.items()]
    for name, data in blobs.items():
        (tmp_path / name).write_bytes(data)
    files = [(str(tmp_path / n), n, size, crc) for n, size, crc in entries]
    proxy.corrupt = (marker, b"safepoint-marked")
    for one in files:
        with pytest.raises(UploadError, match="failed after 2 attempts.*DamagedInTransit") as e:
            layout.put_files(key(1), [one])
        assert "\n" not in str(e.value)
    versions = layout.store.versions  # type: ignore[attr-defined]
    assert all(versions.tag(posixpath.join(key(1), n), size, crc) is None for n, size, crc in entries)
    proxy.corrupt = None
    proxy.reset_counts()
    layout.put_files(key(1), files)
    assert proxy.down < NOTHING, proxy.down  # proven by the ETag: nothing read back
    for name, size, crc in entries:
        path = posixpath.join(key(1), name)
        assert raw.fs().cat_file(path) == blobs[name]
        assert versions.tag(path, size, crc) == _etag(raw, path)


def test_a_source_altered_for_the_copy_and_put_back_before_the_head_is_refused(
    tmp_path: Path, no_crc: tuple[Store, Store, TcpProxy], monkeypatch: pytest.MonkeyPatch
) -> None:
    """moto ignores ``CopySourceIfMatch``, as an S3-compatible store may: a proven source altered before the
    copy and put back (the same bytes: the same ETag) before the HEAD that follows it looks unchanged. The
    copy of a single-part version proves itself instead: its ETag is the MD5 of the bytes copied, equal to
    the source's version only where those are the bytes proven. Here it is not: the copy is read back,
    refused and deleted, never listed under the manifest's crc32c."""
    store, raw, _ = no_crc
    layout = RemoteLayout(store.root(), store.options, transfer=CFG)
    key = layout.step_key
    data = os.urandom(MiB // 2)
    (tmp_path / _SMALL).write_bytes(data)
    entry = (_SMALL, len(data), crc_hex(crc32c.crc32c(data)))
    layout.put_files(key(1), [(str(tmp_path / _SMALL), *entry)])
    src = posixpath.join(key(1), _SMALL)
    _alter_in_place(raw, src)
    real = layout.store.call  # type: ignore[attr-defined]

    async def call(method: str, **kw: Any) -> Any:
        answer = await real(method, **kw)
        if method == "copy_object":  # the copy is made: the source is put back before anyone looks
            await asyncio.to_thread(raw.fs().pipe_file, src, data)  # (off fsspec's loop thread)
        return answer

    monkeypatch.setattr(layout.store, "call", call)
    assert layout.copy_files(1, key(2), [entry]) == [_SMALL]
    assert not raw.fs().exists(posixpath.join(key(2), _SMALL))


def test_a_version_read_back_from_a_store_that_ignores_if_match_is_pinned_by_a_head(
    no_crc: tuple[Store, Store, TcpProxy], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that ignores If-Match on a GET (played by the proxy renaming the header) serves whatever the
    object is now. An object altered (version B) and put back (A) between the HEAD and the read is read as
    A's bytes: version B must not be remembered as proven, or B put again later would be copied on the
    condition B and its copy taken without a read. The version is pinned by a HEAD after the read."""
    store, raw, proxy = no_crc
    layout = RemoteLayout(store.root(), store.options, transfer=CFG)
    path = posixpath.join(layout.step_key(1), _SMALL)
    good = os.urandom(MiB // 2)
    bad = bytearray(good)
    bad[-100] ^= 0xFF
    raw.fs().pipe_file(path, bytes(bad))
    altered = _etag(raw, path)
    proxy.corrupt = (b"If-Match:", b"If-Mbtch:")  # the store no longer sees the condition
    real = layout.store.call  # type: ignore[attr-defined]

    async def call(method: str, **kw: Any) -> Any:
        if method == "get_object" and kw.get("IfMatch") == altered:  # put back before the read
            await asyncio.to_thread(raw.fs().pipe_file, path, good)
        return await real(method, **kw)

    monkeypatch.setattr(layout.store, "call", call)
    crc = crc_hex(crc32c.crc32c(good))
    assert layout.store.prove(path, len(good), crc) == "replaced while it was read back"
    assert layout.store.versions.tag(path, len(good), crc) is None  # type: ignore[attr-defined]
