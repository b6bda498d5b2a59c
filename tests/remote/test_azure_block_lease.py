"""Azure commits whatever block was staged last under each ID of a Put Block List and checks no content:
another writer who stages a block under one of our block IDs between our Put Block and our Put Block List
had its bytes committed into our blob, whose version was then remembered as proven (every one of our
blocks having passed Content-MD5) and listed in the manifest: found only at load. A random block ID
does not keep it out: anyone who may read the blob lists its uncommitted IDs (Get Block List), as the
other writer here does. The upload now holds a lease on the blob from before its first block to its
Put Block List (remote/azlease.py): Azure refuses the other writer's block, and a writer who breaks the
lease makes our commit fail, so the upload is made again.

Against Azurite (skipped without node, tests/helpers/stores.py); every test here fails on the code before.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import crc32c
import pytest

from safepoint.remote.azstore import AzureStore
from safepoint.remote.s3writer import open_writer
from safepoint.remote.upload import FileCopy, MiB, TransferOptions
from safepoint.store.checksum import crc_hex
from tests.helpers.stores import azure_store

CFG = TransferOptions(part_size=5 * MiB, concurrency=4, attempts=3, backoff_s=0.0, max_backoff_s=0.0)
SIZE = 6 * MiB + 3  # two blocks


@pytest.fixture
def az(azurite_endpoint: str) -> Iterator[tuple[AzureStore, Any, str]]:
    """(safepoint's store on Azurite, another writer's own client, a blob path in a fresh container)."""
    import adlfs
    from azure.storage.blob import BlobServiceClient

    raw = azure_store(azurite_endpoint)
    fs = adlfs.AzureBlobFileSystem(skip_instance_cache=True, **raw.options)
    other = BlobServiceClient.from_connection_string(raw.options["connection_string"])
    yield AzureStore(fs, CFG), other, f"{raw.make_bucket()}/obj.bin"


def _competitor(
    store: AzureStore, monkeypatch: pytest.MonkeyPatch, other: Any, path: str, *, breaks: bool
) -> list[str]:
    """Before our first Put Block List, the other writer lists our uncommitted block IDs and stages a
    block of its own, of the same size, under the first one (``breaks``: after breaking any lease on the
    blob). What happened to its attempts, in order."""
    container, blob = path.split("/", 1)
    client = other.get_blob_client(container, blob)
    seen: list[str] = []
    real = store.commit_blocks

    def stage_ours() -> None:
        from azure.core.exceptions import HttpResponseError
        from azure.storage.blob import BlobLeaseClient

        if breaks:
            try:
                BlobLeaseClient(client).break_lease(lease_break_period=0)
                seen.append("broke the lease")
            except HttpResponseError as e:
                seen.append(f"break: {_code(e)}")
        first = client.get_block_list("uncommitted")[1][0]
        try:
            client.stage_block(first.id, os.urandom(first.size))
            seen.append("staged")
        except HttpResponseError as e:
            seen.append(f"stage: {_code(e)}")

    async def commit(*args: Any, **kw: Any) -> Any:
        if not seen:
            await asyncio.to_thread(stage_ours)
        return await real(*args, **kw)

    monkeypatch.setattr(store, "commit_blocks", commit)
    return seen


def _upload(store: AzureStore, tmp_path: Path, path: str, data: bytes, how: str) -> None:
    if how == "file":
        (tmp_path / "obj.bin").write_bytes(data)
        crc = crc_hex(crc32c.crc32c(data))
        store.put_files([FileCopy(str(tmp_path / "obj.bin"), path, len(data), crc)])
    else:  # DCP's stream straight to the store (no local tier)
        writer = open_writer(store, path)
        writer.write(data)
        writer.close()


@pytest.mark.parametrize("how", ["file", "stream"])
def test_a_block_staged_under_our_id_by_another_writer_is_refused(
    az: tuple[AzureStore, Any, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    store, other, path = az
    data = os.urandom(SIZE)
    seen = _competitor(store, monkeypatch, other, path, breaks=False)
    _upload(store, tmp_path, path, data, how)
    assert store.fs.cat_file(path) == data
    assert seen == ["stage: LeaseIdMissing"]  # Azure refused it: the blob is leased
    crc = crc_hex(crc32c.crc32c(data))
    assert store.versions.tag(path, len(data), crc) == store.run(store.etag, path)
    assert _lease_state(other, path) == "available"  # released once committed


def test_a_writer_that_breaks_the_lease_makes_the_upload_start_again(
    az: tuple[AzureStore, Any, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any writer may break a lease; its block then goes in, but our Put Block List, which carries the
    lease, is refused (LeaseNotPresentWithBlobOperation): the whole file is sent again."""
    store, other, path = az
    data = os.urandom(SIZE)
    seen = _competitor(store, monkeypatch, other, path, breaks=True)
    _upload(store, tmp_path, path, data, "file")
    assert store.fs.cat_file(path) == data
    assert seen == ["broke the lease", "staged"]
    crc = crc_hex(crc32c.crc32c(data))
    assert store.versions.tag(path, len(data), crc) == store.run(store.etag, path)


def test_a_stream_whose_lease_was_broken_fails_and_leaves_no_blob(
    az: tuple[AzureStore, Any, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streamed there is nothing to send again from: the write fails in one line, and the blob made for
    the lease is deleted (an aborted stream leaves nothing at the key, as before)."""
    from safepoint.remote.upload import StreamWriteError

    store, other, path = az
    seen = _competitor(store, monkeypatch, other, path, breaks=True)
    writer = open_writer(store, path)
    writer.write(os.urandom(SIZE))
    with pytest.raises(StreamWriteError, match="lease") as e:
        writer.close()
    assert "\n" not in str(e.value)
    assert seen == ["broke the lease", "staged"]
    assert not store.fs.exists(path)


def _stall(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """``stall()``: block the event loop's thread for 0.6 s (no renewal can be made) against a lapse limit
    of 0.3 s for that moment only. The limit goes back to its default as soon as the lease is found to
    have lapsed, so the upload made again is judged by the real limit: with 0.3 s throughout, a loaded
    machine's renewals (requests to Azurite) could miss it again, and every attempt failed (seen once)."""
    from safepoint.remote import azlease

    default, real_check = azlease.LAPSE_S, azlease.BlobLease.check

    def check(self: azlease.BlobLease) -> None:
        try:
            real_check(self)
        except azlease.LeaseLapsed:
            monkeypatch.setattr(azlease, "LAPSE_S", default)
            raise

    monkeypatch.setattr(azlease.BlobLease, "check", check)

    def stall() -> None:
        monkeypatch.setattr(azlease, "LAPSE_S", 0.3)
        time.sleep(0.6)  # on the loop's thread: the renewals stall with it

    return stall


def test_a_lease_that_may_have_lapsed_makes_the_upload_start_again(
    az: tuple[AzureStore, Any, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The event loop stalls (here for 0.6 s, against a lapse limit shrunk to 0.3 s) before the commit, so
    no renewal could be made: the lease may have lapsed and another writer's block gone in unseen, so that
    attempt commits nothing and the file is sent again."""
    stall = _stall(monkeypatch)
    store, _, path = az
    data = os.urandom(SIZE)
    commits: list[str] = []
    real = store.commit_blocks

    async def commit(*args: Any, **kw: Any) -> Any:
        if not commits:
            stall()
        try:
            return await real(*args, **kw)
        except Exception as e:
            commits.append(type(e).__name__)
            raise
        finally:
            commits.append("tried")

    monkeypatch.setattr(store, "commit_blocks", commit)
    _upload(store, tmp_path, path, data, "file")
    assert store.fs.cat_file(path) == data
    assert commits == ["DamagedInTransit", "tried", "tried"]


def test_a_lease_left_by_a_killed_writer_neither_blocks_a_new_upload_nor_a_delete(
    az: tuple[AzureStore, Any, str], tmp_path: Path
) -> None:
    """A writer killed mid-upload leaves its blob leased (for up to a minute): the next upload to that
    key breaks the lease, and so does a delete (cleanup of the killed save)."""
    store, other, path = az
    container, blob = path.split("/", 1)
    client = other.get_blob_client(container, blob)
    for how, data in (("file", os.urandom(SIZE)), ("stream", os.urandom(MiB)), ("file", os.urandom(MiB))):
        client.upload_blob(b"", overwrite=True)
        client.acquire_lease(lease_duration=60)
        _upload(store, tmp_path, path, data, how)
        assert store.fs.cat_file(path) == data, how
    client.acquire_lease(lease_duration=60)
    store.delete([path])
    assert not store.fs.exists(path)


def _code(e: Any) -> str:
    return str(getattr(e.error_code, "value", e.error_code))


def _lease_state(other: Any, path: str) -> str:
    container, blob = path.split("/", 1)
    return str(other.get_blob_client(container, blob).get_blob_properties().lease.state)


def test_a_commit_retried_after_the_lease_may_have_lapsed_commits_nothing(
    az: tuple[AzureStore, Any, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lapse check ran once, before the first Put Block List attempt: a retried attempt (the first one
    stalled, here 0.6 s against a lapse limit of 0.3 s, and got no answer) committed the staged blocks
    even though no renewal had been made for longer than the lease may last, so another writer's block
    could have gone in meanwhile. Every attempt is checked now: that one commits nothing and the file is
    sent again."""
    stall = _stall(monkeypatch)
    store, _, path = az
    data = os.urandom(SIZE)
    seen: list[str] = []
    real_client = store.client

    def client(p: str) -> Any:
        c = real_client(p)
        stage, commit = c.stage_block, c.commit_block_list

        async def stage_block(*a: Any, **kw: Any) -> Any:
            seen.append("stage")
            return await stage(*a, **kw)

        async def commit_block_list(*a: Any, **kw: Any) -> Any:
            if "stalled" not in seen:
                seen.append("stalled")
                stall()
                raise ConnectionError("no answer")
            seen.append("commit")
            return await commit(*a, **kw)

        c.stage_block, c.commit_block_list = stage_block, commit_block_list
        return c

    monkeypatch.setattr(store, "client", client)
    _upload(store, tmp_path, path, data, "file")
    assert store.fs.cat_file(path) == data
    assert seen == ["stage", "stage", "stalled", "stage", "stage", "commit"]
