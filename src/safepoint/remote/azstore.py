"""Azure Blob transfers that the store itself verifies: every request body carries its Content-MD5.

Azure keeps no crc32c of a blob (and no checksum at all of one assembled from blocks), so the check has to
happen on the way in: every block (Put Block) and every small blob (Put Blob) goes up with the MD5 of its
bytes in ``Content-MD5``, computed from the same buffer whose crc32c the manifest records; Azure computes
the MD5 of what arrived and refuses a mismatch (``Md5Mismatch``, retried like any transient error). A
blob is then exactly the blocks committed by ``Put Block List``, each confirmed, in the order listed, and
before committing, the blocks' crc32c are combined and compared with the manifest, so a local file that
changed since it was written is never uploaded. Afterwards the blob's size is checked once more. From the
first block to the commit the blob is leased (azlease.py), so no other writer's block can be committed
under one of our block IDs.

Server-side copies: Azure keeps no crc32c of a blob, and a Copy Blob's status proves only that the copy
finished, not which bytes it copied (a source altered in place at the same size copies "successfully").
So a copy is proven by the source's version: the blobs this process wrote (checked as above) or read back
are remembered by their ETag (remote/versions.py), a copy from one of them is made on the condition that
the source still has that ETag (``x-ms-source-if-match``, which Azure checks), and the copy's own ETag is
remembered in turn. Any other copy is read back (``prove``): once per group after a restart.

Requests go through adlfs's own async Azure SDK client (its credentials, endpoint and transport), on
fsspec's event loop; each is retried by safepoint's policy (retry.py) on top of the SDK's own retries.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import crc32c

from safepoint.remote.azbase import AzureBase
from safepoint.remote.azlease import BlobLease, break_lease, lease_lost, put_over_lease
from safepoint.remote.retry import DamagedInTransit, UploadError, retry
from safepoint.remote.stream import PartWriter
from safepoint.remote.upload import FileCopy, RawWriter, check_local, combine, read_range
from safepoint.store.checksum import crc_hex
from safepoint.store.manifest import Parts

T = TypeVar("T")
# A Copy Blob Azure reports "pending" is polled from this interval (doubling to 1 s) for at most this long.
COPY_POLL_S = 0.05
COPY_WAIT_S = 600.0
# azure-storage-blob's own limit for one Put Blob (its max_single_put_size, which adlfs leaves at the
# default): above it upload_blob stages blocks itself and sends our whole-body Content-MD5 with each, which
# Azure refuses. So a body above it goes up as our own blocks, each with its own Content-MD5.
SINGLE_PUT_MAX = 64 * 1024 * 1024


def md5_header(data: bytes | memoryview) -> dict[str, str]:
    """The ``Content-MD5`` header for a request body: Azure refuses the request if the bytes differ."""
    return {"Content-MD5": base64.b64encode(hashlib.md5(data).digest()).decode()}


def _block_id(n: int, upload: str) -> str:
    # Ids must be the same length within a blob; the upload attempt's own random prefix (a uuid4, 128
    # bits) keeps a retried or concurrent upload's blocks apart from this one's and cannot be guessed.
    # It does not keep another writer out (the uncommitted IDs can be listed): the lease does, azlease.py.
    return base64.b64encode(f"{upload}-{n:06d}".encode()).decode()


class AzureStore(AzureBase):
    """ObjectStore for adlfs.AzureBlobFileSystem: blocks and blobs checked by Azure's Content-MD5."""

    @property
    def part_size(self) -> int:
        """Block size and the largest file sent in one Put Blob: ``part_size``, at most SINGLE_PUT_MAX."""
        return min(self.cfg.part_size, SINGLE_PUT_MAX)

    async def stage(self, path: str, block_id: str, data: bytes, what: str, lease: BlobLease) -> None:
        headers = await self._in_pool(md5_header, data)
        client = self.client(path)
        with _lost_lease(path):
            await self.aretry(
                what,
                lambda: client.stage_block(block_id, data, length=len(data), headers=headers, lease=lease.id),
            )

    async def commit_blocks(self, path: str, ids: list[str], what: str, lease: BlobLease) -> str | None:
        """Commit the block list under ``lease`` (held since before the first block: no other writer's
        block can be among them, azlease.py); the blob's new ETag (the version those blocks make)."""
        from azure.storage.blob import BlobBlock

        blocks = [BlobBlock(i) for i in ids]
        client = self.client(path)

        async def commit() -> Any:
            lease.check()  # before every attempt: a retry may come after the lease lapsed (azlease.py)
            r = await client.commit_block_list(blocks, lease=lease.id)
            lease.check()  # a renewal that revived a lapsed lease while the commit was on its way
            return r

        with _lost_lease(path):
            r = await self.aretry(f"{what} (commit)", commit)
        return _etag(r)

    async def put_blob(self, path: str, data: bytes, what: str) -> str | None:
        """Put Blob with the data's Content-MD5; the blob's new ETag."""
        headers = await self._in_pool(md5_header, data)
        r = await self.aretry(what, lambda: put_over_lease(self, path, data, headers))
        return _etag(r)

    async def etag(self, path: str) -> str | None:
        """The blob's ETag now (its version), or None where there is no blob."""
        from azure.core.exceptions import ResourceNotFoundError

        try:
            props = await self.aretry(f"stat of {self.url(path)}", self.client(path).get_blob_properties)
        except UploadError as e:
            if isinstance(e.__cause__, ResourceNotFoundError):
                return None
            raise
        return _etag(props)

    # ---- small objects ----------------------------------------------------------------------------------

    def delete(self, paths: Sequence[str]) -> None:
        """Delete ``paths``; a blob a killed writer left leased (azlease.py: for at most a minute) has its
        lease broken and is deleted then (only the root's lease holder deletes under it)."""
        try:
            super().delete(paths)
        except UploadError as e:
            if "LeaseIdMissing" not in str(e):
                raise
            self.run(self._break_leases, list(paths))
            super().delete(paths)

    async def _break_leases(self, paths: list[str]) -> None:
        async def one(path: str) -> None:
            async with self.sem:
                await break_lease(self, path)

        await asyncio.gather(*(one(p) for p in paths))

    def put_bytes(self, path: str, data: bytes, *, if_absent: bool = False) -> None:
        if if_absent:
            raise NotImplementedError("az:// creates conditionally through remote/conditional.py")
        self.confirmed.forget(path)
        self.run(self.put_blob, path, data, f"write of {self.url(path)}")
        # Azure checked the body's Content-MD5 (put_blob): the blob holds these bytes.
        self.confirmed.remember(path, len(data), crc_hex(crc32c.crc32c(data)))
        self.fs.invalidate_cache(path)

    # ---- server-side copies -----------------------------------------------------------------------------

    def copy(self, src: str, dst: str, size: int | None = None, crc: str | None = None) -> None:
        """Copy Blob within the account (no client bytes), waited for until the store reports it done.

        adlfs's ``copy`` only *starts* the copy: Azure may answer ``x-ms-copy-status: pending`` and finish
        later (a large blob, a busy account), and a blob that is still being copied, or whose copy failed
        or was aborted, must never be committed. The status proves the copy finished, not its bytes: where
        ``src`` is a version this process proved to hold ``size`` bytes of crc32c ``crc``, the copy is
        made on the condition that it still is that version (Azure refuses it otherwise: UploadError), and
        the copy's version is remembered as proven too (``prove`` then needs no read)."""
        what = f"copy of {self.url(src)}"
        source = self.versions.tag(src, size, crc) if size is not None and crc is not None else None
        self.versions.forget(dst)
        tag = self.run(self.aretry, what, lambda: self._copy(src, dst, source))
        if source is not None and size is not None and crc is not None:
            self.versions.remember(dst, tag, size, crc)
        self.fs.invalidate_cache(dst)

    async def _copy(self, src: str, dst: str, source: str | None) -> str | None:
        """Copy ``src`` (on the condition that its ETag is ``source``, where given) to ``dst``; the ETag of
        the copy once Azure reports it done."""
        from azure.core import MatchConditions

        target = self.client(dst)
        cond: dict[str, Any] = {}
        if source is not None:
            cond = {"source_etag": source, "source_match_condition": MatchConditions.IfNotModified}
        started = await target.start_copy_from_url(self.client(src).url, **cond)
        copy_id, status, tag = started.get("copy_id"), started.get("copy_status"), _etag(started)
        delay, deadline = COPY_POLL_S, asyncio.get_running_loop().time() + COPY_WAIT_S
        while status == "pending":
            if asyncio.get_running_loop().time() > deadline:
                with contextlib.suppress(Exception):
                    await target.abort_copy(copy_id)
                raise UploadError(f"copy to {self.url(dst)} still pending after {COPY_WAIT_S:.0f} s; aborted")
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)
            props = await target.get_blob_properties()
            if props.copy.id != copy_id:
                raise DamagedInTransit(f"another copy replaced this one at {self.url(dst)}")
            status, tag = props.copy.status, _etag(props)
        if status != "success":  # failed or aborted: transient, copied again (then UploadError)
            raise DamagedInTransit(f"the store reports the copy to {self.url(dst)} as {status}")
        return tag

    def prove(self, path: str, size: int, crc: str, parts: Parts | None = None) -> str | None:
        """Why the blob at ``path`` is not proven to hold ``size`` bytes of crc32c ``crc``, or None: by its
        version where this process proved that (one properties request), else read back, and its version
        remembered where it did not change while it was read (an ETag is never reused)."""
        before = self.run(self.etag, path)
        if before is not None and self.versions.tag(path, size, crc) == before:
            return None
        problem = self.check(path, size, crc, read=True)
        if problem is None and before is not None and self.run(self.etag, path) == before:
            self.versions.remember(path, before, size, crc)
        return problem

    # ---- files ------------------------------------------------------------------------------------------

    def put_file(self, item: FileCopy) -> None:
        what = f"upload of {item.local} to {self.url(item.remote)}"

        # The whole file again if the blob turns out other than sent (DamagedInTransit from confirm).
        def once() -> None:
            self.versions.forget(item.remote)
            tag = self.run(self._put_file, item, what)
            if item.size > self.part_size:  # (one Put Blob: Azure checked its whole body's MD5)
                self.confirm(item)  # the blob the committed block list made has the file's size
            self.versions.remember(item.remote, tag, item.size, item.crc32c)

        retry(what, once, self.cfg)

    async def _put_file(self, item: FileCopy, what: str) -> str | None:
        """Upload ``item`` (its blocks checked by Azure, their crc32c by the manifest); the blob's ETag."""
        psize = self.part_size
        if item.size <= psize:
            async with self.sem:
                await self._in_pool(self.pass_gate)
                data, crc = await self._in_pool(read_range, item.local, 0, item.size, item.root)
                check_local(item, crc_hex(crc))
                return await self.put_blob(item.remote, data, what)
        upload = uuid.uuid4().hex
        lease = BlobLease(self, item.remote, what)
        await lease.begin()

        async def block(n: int, off: int) -> tuple[str, int, int]:
            length = min(psize, item.size - off)
            async with self.sem:
                await self._in_pool(self.pass_gate)
                data, crc = await self._in_pool(read_range, item.local, off, length, item.root)
                await self.stage(item.remote, _block_id(n, upload), data, f"{what} (block {n})", lease)
            return _block_id(n, upload), crc, length

        tasks = [asyncio.ensure_future(block(n, off)) for n, off in enumerate(range(0, item.size, psize))]
        try:
            try:
                done = await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise  # staged blocks that are never committed are dropped by Azure (after a week)
            check_local(item, combine([(crc, n) for _, crc, n in done]))
            tag = await self.commit_blocks(item.remote, [i for i, _, _ in done], what, lease)
        except BaseException:
            await lease.end(committed=False)
            raise
        await lease.end(committed=True)
        return tag

    def open_writer(self, path: str) -> RawWriter:
        return AzureWriter(self, path)


class AzureWriter(PartWriter):
    """DCP's stream to one blob (stream.PartWriter): blocks go up (each with its Content-MD5) while DCP is
    still writing; close commits the block list (a small file is one Put Blob); abort commits nothing, so
    no blob appears (staged blocks that are never committed are dropped by Azure)."""

    def __init__(self, store: AzureStore, path: str) -> None:
        super().__init__(
            store.fs.loop, store.part_size, store.cfg.concurrency, f"upload of {store.url(path)}"
        )
        self._s, self._path = store, path
        self._upload = uuid.uuid4().hex
        self._lease = BlobLease(store, path, self._what)
        self._leased = False

    def _begin(self) -> None:
        self._s.versions.forget(self._path)
        self._s.confirmed.forget(self._path)
        self._s.run(self._lease.begin)  # the blob leased before its first block goes up (azlease.py)
        self._leased = True

    async def _part(self, n: int, data: bytes, crc: int) -> str:
        block_id = _block_id(n - 1, self._upload)
        await self._s.stage(self._path, block_id, data, f"{self._what} (block {n})", self._lease)
        return block_id

    # The blob is the bytes streamed in, each block checked by Azure's Content-MD5: its version is proven
    # to hold the crc32c of those bytes (the one DCP's stream records for the manifest).
    def _whole(self, data: bytes) -> None:
        self._s.versions.forget(self._path)
        self._s.confirmed.forget(self._path)
        tag = self._s.run(self._s.put_blob, self._path, data, self._what)
        crc = crc_hex(crc32c.crc32c(data))
        self._s.versions.remember(self._path, tag, len(data), crc)
        self._s.confirmed.remember(self._path, len(data), crc)
        self._s.fs.invalidate_cache(self._path)

    def _finish(self, sent: list[str]) -> None:
        self._s.versions.forget(self._path)
        tag = self._s.run(self._s.commit_blocks, self._path, sent, self._what, self._lease)
        self._leased = False
        self._s.run(functools.partial(self._lease.end, committed=True))
        size, crc = sum(n for _, n in self._crcs), combine(self._crcs)
        self._s.versions.remember(self._path, tag, size, crc)
        self._s.confirmed.remember(self._path, size, crc)
        self._s.fs.invalidate_cache(self._path)

    def _drop(self) -> None:
        if self._leased:  # the blob made for the lease goes too: an aborted write leaves nothing
            self._leased = False
            self._s.run(functools.partial(self._lease.end, committed=False))
            self._s.fs.invalidate_cache(self._path)


@contextlib.contextmanager
def _lost_lease(path: str) -> Iterator[None]:
    """A request refused because our lease on the blob is gone (another writer broke it) or may have lapsed
    fails the whole upload attempt as DamagedInTransit (made again), not just that request."""
    try:
        yield
    except UploadError as e:
        if lease_lost(cause := e.__cause__ or e):
            code = getattr(cause, "error_code", None)
            code = getattr(code, "value", code)  # a StorageErrorCode enum, or our LeaseLapsed's string
            raise DamagedInTransit(f"the lease on {path} was lost or may have lapsed ({code})") from e
        raise


def _etag(answer: Any) -> str | None:
    """The ETag in an Azure SDK answer (a dict, or a BlobProperties)."""
    tag = answer.get("etag") if isinstance(answer, dict) else getattr(answer, "etag", None)
    return tag if isinstance(tag, str) and tag else None
