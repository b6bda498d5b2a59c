"""The base of ``S3Store``: requests to S3 under one retry policy, and reading (objects, stored checksums,
ranged reads, listings). s3store.py adds the writes.

Every request goes straight to s3fs's aiobotocore client (see s3store.py), listings and deletes included:
through s3fs's own retry wrapper each of our attempts would be several.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import crc32c
from fsspec.asyn import sync

from safepoint.remote.retry import (
    DamagedInTransit,
    TransferOptions,
    UploadError,
    cause_code,
    lower_priority,
    retry_async,
)
from safepoint.remote.upload import ObjectStore, b64_crc, combine, hex_crc, write_at
from safepoint.remote.versions import ProvenVersions
from safepoint.store.checksum import crc_hex
from safepoint.store.manifest import Parts

T = TypeVar("T")
log = logging.getLogger("safepoint")

NOT_FOUND = ("404", "NoSuchKey", "NotFound")
MD5 = "_md5"  # a sent part's MD5 beside S3's fields (S3Store.send_part); never sent to S3


class S3Reader(ObjectStore):
    """Requests to S3 through s3fs's client under one retry policy, and every read; S3Store adds writes."""

    def __init__(self, fs: Any, cfg: TransferOptions | None = None) -> None:
        super().__init__(fs, cfg)
        self._sem: asyncio.Semaphore | None = None
        # Reading parts and their crc32c happens off the event loop (both release the GIL).
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.cfg.concurrency,
            "safepoint-s3io",
            initializer=lower_priority if self.cfg.background else None,
        )
        self.versions = ProvenVersions()
        """The object versions (ETags) whose bytes this process proved where the store keeps no CRC32C of
        them (remote/versions.py; ``prove`` and S3Store's writes and copies): nothing otherwise."""

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        result: T = sync(self.fs.loop, fn, *args)
        return result

    @property
    def sem(self) -> asyncio.Semaphore:
        if self._sem is None:  # created on the loop thread, where every coroutine runs
            self._sem = asyncio.Semaphore(self.cfg.concurrency)
        return self._sem

    async def call(self, method: str, **kw: Any) -> Any:
        await self.fs.set_session()
        client = await self.fs.get_s3(kw.get("Bucket"))
        fn = getattr(client, method)
        # s3fs adds the user's s3_additional_kwargs (SSE, ACL, RequestPayer ...) and drops unknown ones.
        return await fn(**self.fs._get_s3_method_kwargs(fn, **kw))

    async def aretry(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        return await retry_async(what, fn, self.cfg)

    def _split(self, path: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(path)
        return bucket, key

    async def _gate(self) -> None:
        if not self.gate.is_set():  # a save is blocking training: wait (off the loop) until it is done
            await self._in_pool(self.pass_gate)

    async def _in_pool(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ---- reading ----------------------------------------------------------------------------------------

    def sizes(self, prefix: str) -> dict[str, int]:
        """{key relative to prefix: size} of every object under ``prefix``: one paginated LIST."""
        bucket, key = self._split(prefix)
        key = key.rstrip("/")
        base = f"{key}/" if key else ""  # a root at the top of the bucket: every key is under it

        async def listing() -> dict[str, int]:
            out: dict[str, int] = {}
            token: dict[str, str] = {}
            while True:
                r = await self.call("list_objects_v2", Bucket=bucket, Prefix=base, **token)
                out.update({o["Key"][len(base) :]: int(o["Size"]) for o in r.get("Contents", [])})
                if not r.get("IsTruncated"):
                    return out
                token = {"ContinuationToken": r["NextContinuationToken"]}

        return dict(self.run(self.aretry, f"listing of {self.url(prefix)}", listing))

    def get_bytes(self, path: str, limit: int | None = None) -> bytes:
        bucket, key = self._split(path)
        ranged = {} if limit is None else {"Range": f"bytes=0-{limit}"}

        async def get() -> bytes:
            try:
                r = await self.call("get_object", Bucket=bucket, Key=key, **ranged)
            except Exception as e:
                if ranged and cause_code(e) == "InvalidRange":
                    return b""  # no byte 0: an empty object (a range from 0 is unsatisfiable only so)
                raise
            async with r["Body"] as body:
                return bytes(await body.read())

        try:
            return bytes(self.run(self.aretry, f"read of {self.url(path)}", get))
        except UploadError as e:
            if cause_code(e) in NOT_FOUND:
                raise FileNotFoundError(self.url(path)) from None
            raise

    def stored_checksum(self, path: str, parts: Parts | None = None) -> tuple[int, str | None]:
        bucket, key = self._split(path)
        try:
            head = self.run(self.aretry, f"stat of {self.url(path)}", lambda: self._head(bucket, key))
        except UploadError as e:
            if cause_code(e) in NOT_FOUND:
                raise FileNotFoundError(self.url(path)) from None
            raise
        size, crc = int(head["ContentLength"]), head.get("ChecksumCRC32C")
        if not isinstance(crc, str):
            return size, None
        if not composite(head):
            return size, hex_crc(crc)
        # A composite value is not the file's crc32c; with the parts the upload recorded it vouches for one.
        return size, None if parts is None else vouched(crc, parts, size)

    async def _head(self, bucket: str, key: str) -> Any:
        return await self.call("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")

    async def settle(self, path: str, head: Any, size: int, crc: str, sent: str | None, what: str) -> None:
        """Prove an upload of ``path`` (``size`` bytes whose crc32c ``crc`` the client computed of what it
        sent and compared with the manifest) where the store reports no CRC32C of it; ``head``: the HEAD
        after the upload (its size already checked), whose ETag is the version now at the key; ``sent``:
        the ETag S3 gives the bytes sent (``sent_etag``), None where unknown.

        That ETag proves the store holds what was sent (as Azure's Content-MD5 shows) and the version is
        remembered as proven. Any other (bytes damaged on the way in, another object of the same size put
        at the key after a completion whose answer was lost, or an ETag that is not an MD5: SSE-KMS,
        SSE-C, a store of its own kind) proves nothing: the object is read back under that ETag, and a
        crc32c other than ``crc`` raises DamagedInTransit (the upload is made again, then fails as an
        UploadError): never taken by its size. Where the read proves it, its version is remembered once a
        HEAD shows it unchanged (a store may ignore If-Match, as ``prove`` explains)."""
        tag = head.get("ETag") if isinstance(head, dict) else None
        tag = tag if isinstance(tag, str) and tag else None
        if tag is not None and tag == sent:
            self.versions.remember(path, tag, size, crc)
            return
        self.versions.forget(path)
        log.info(
            "safepoint: %s: the store reports no CRC32C and ETag %s, not %s (the MD5 of the bytes sent); "
            "reading it back",
            what,
            tag,
            sent,
        )
        if (got := await self.aread_crc(path, size, tag)) != crc:
            raise DamagedInTransit(f"the store holds bytes of crc32c {got}, expected {crc} (ETag {tag})")
        bucket, key = self._split(path)
        again = await self.aretry(f"{what} (confirm)", lambda: self._head(bucket, key))
        if tag is not None and again.get("ETag") == tag:
            self.versions.remember(path, tag, size, crc)

    def prove(self, path: str, size: int, crc: str, parts: Parts | None = None) -> str | None:
        """Why ``path`` is not proven to hold ``size`` bytes of crc32c ``crc``, or None: by S3's own CRC32C
        (one HEAD), else by its version (the HEAD's ETag) where this process proved that one, else read back
        under that one ETag (every ranged GET ``If-Match``: a version replaced midway fails the read, never
        mixes two) and that version remembered (remote/versions.py)."""
        bucket, key = self._split(path)
        try:
            head = self.run(self.aretry, f"stat of {self.url(path)}", lambda: self._head(bucket, key))
        except UploadError as e:
            if cause_code(e) in NOT_FOUND:
                return "file is missing"
            raise
        tag, stored = head.get("ETag"), head.get("ChecksumCRC32C")
        if int(head["ContentLength"]) != size:
            return f"size {head['ContentLength']} != {size} (truncated or extended)"
        value = hex_crc(stored) if isinstance(stored, str) and not composite(head) else None
        if isinstance(stored, str) and composite(head) and parts is not None:  # as the upload's parts vouch
            value = vouched(stored, parts, size)
        if value is not None:  # S3's own CRC32C of the bytes it holds: no version needed
            return None if value == crc else f"crc32c {value} != {crc} (contents altered)"
        if not isinstance(tag, str):
            return self.check(path, size, crc, read=True)
        if self.versions.tag(path, size, crc) == tag:
            return None
        if (got := self.read_crc(path, size, tag)) != crc:
            return f"crc32c {got} != {crc} (contents altered)"
        # A store that ignores If-Match on a GET (as moto ignores CopySourceIfMatch) could serve another
        # version than ``tag``: remembered only if it still is ``tag`` after the read, as on Azure.
        if not self.unchanged(path, tag):
            return "replaced while it was read back"
        self.versions.remember(path, tag, size, crc)
        return None

    def unchanged(self, path: str, tag: str) -> bool:
        """Whether ``path`` still is version ``tag`` (a HEAD); forgotten as proven where it is not.

        After a copy made on the condition ``CopySourceIfMatch`` = ``tag``: where the store checks the
        condition that is already certain, but moto ignores it (5.2), and so may an S3-compatible store.
        The source still being that version after the copy then leaves unseen only an alteration made and
        put back while the copy ran (docs/reliability.md): the copy could hold it, and load would find it."""
        bucket, key = self._split(path)
        try:
            head = self.run(self.aretry, f"stat of {self.url(path)}", lambda: self._head(bucket, key))
        except UploadError:
            head = {}
        if head.get("ETag") == tag:
            return True
        self.versions.forget(path)
        return False

    def copied_from(self, src: str, source: str, got: Any) -> bool:
        """Whether a copy whose ETag is ``got`` holds the bytes of ``src``'s proven version ``source``. A
        single-part version's ETag is the MD5 of its bytes, and so is CopyObject's copy's: equal proves it,
        another refuses it, whatever the store did with ``CopySourceIfMatch`` (moto ignores it), a source
        altered for the copy and put back before a HEAD included. A multipart one's ("-<parts>") is not its
        bytes' MD5: the source still being that version after the copy (a HEAD) stands in for it."""
        if isinstance(got, str) and "-" not in source and "-" not in got:
            return got == source
        return self.unchanged(src, source)

    async def answer_md5(self, answer: Any, data: bytes) -> bytes | None:
        """The MD5 of ``data`` where the store's ``answer`` to its upload carries no CRC32C (the ETag is then
        what can show the store holds what was sent: ``settle``); None where it does (no cost on S3)."""
        if isinstance(answer, dict) and "ChecksumCRC32C" in answer:
            return None
        return await self._in_pool(md5_of, data)

    async def _get_range(self, bucket: str, key: str, off: int, n: int, tag: str | None = None) -> bytes:
        cond = {"IfMatch": tag} if tag else {}
        r = await self.call("get_object", Bucket=bucket, Key=key, Range=f"bytes={off}-{off + n - 1}", **cond)
        async with r["Body"] as body:
            data = bytes(await body.read())
        if len(data) != n:
            raise ConnectionError(f"short read: {len(data)} of {n} bytes")  # transient: retried
        return data

    def _ranges(self, size: int) -> list[tuple[int, int]]:
        p = self.cfg.part_size
        return [(off, min(p, size - off)) for off in range(0, size, p)]

    def read_crc(self, path: str, size: int, tag: str | None = None) -> str:
        """crc32c of the object (``tag``: of that version only; another fails the read, UploadError)."""
        return self.run(self.aread_crc, path, size, tag)

    async def aread_crc(self, path: str, size: int, tag: str | None = None) -> str:
        """``read_crc`` on the event loop."""
        bucket, key = self._split(path)
        what = f"read of {self.url(path)}"

        async def one(off: int, n: int) -> tuple[int, int]:
            async with self.sem:
                data = await self.aretry(what, lambda: self._get_range(bucket, key, off, n, tag))
                return await self._in_pool(crc32c.crc32c, data), n

        return combine(await self._gather([one(o, n) for o, n in self._ranges(size)]))

    def download(self, path: str, fd: int, size: int) -> str:
        """Ranged GETs in parallel into the new local file open as ``fd`` (the caller made it through the
        guarded walk, store/rootfs.py, and closes it); fsync'd; the crc32c of the bytes written."""
        bucket, key = self._split(path)
        what = f"download of {self.url(path)}"

        def put(data: bytes, off: int) -> int:
            write_at(fd, data, off)
            return int(crc32c.crc32c(data))

        async def one(off: int, n: int) -> tuple[int, int]:
            async with self.sem:
                data = await self.aretry(what, lambda: self._get_range(bucket, key, off, n))
                return await self._in_pool(put, data, off), n

        crc = combine(self.run(self._gather, [one(o, n) for o, n in self._ranges(size)]))
        os.fsync(fd)
        return crc

    @staticmethod
    async def _gather(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
        """Run all; on the first failure cancel the rest (their multipart uploads are aborted), raise it."""
        tasks: list[asyncio.Task[T]] = []
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(c) for c in coros]
        except BaseExceptionGroup as eg:
            errors = [e for e in eg.exceptions if not isinstance(e, asyncio.CancelledError)]
            raise (errors or list(eg.exceptions))[0] from None
        return [t.result() for t in tasks]


def md5_of(data: bytes) -> bytes:
    return hashlib.md5(data, usedforsecurity=False).digest()


def sent_etag(md5s: Sequence[bytes | None], multipart: bool) -> str | None:
    """The ETag S3 gives an object of the bytes sent, from their MD5 (``md5s``: of the one body, or of
    each part in order: the MD5 of their digests, "-<parts>"); None where a part's MD5 is unknown."""
    if not md5s or any(m is None for m in md5s):
        return None
    if not multipart:
        return f'"{md5s[0].hex()}"' if md5s[0] is not None else None
    return f'"{hashlib.md5(b"".join(m for m in md5s if m is not None)).hexdigest()}-{len(md5s)}"'


def composite_value(crcs: Sequence[int]) -> str:
    """S3's composite CRC32C of parts with these crc32cs: crc32c of their big-endian bytes (base64)."""
    return b64_crc(crc_hex(crc32c.crc32c(b"".join(c.to_bytes(4, "big") for c in crcs))))


def vouched(stored: str, parts: Parts, size: int) -> str | None:
    """The file's crc32c that a store's composite checksum ``stored`` vouches for, given the parts the upload
    recorded: their combination, if the store's value is the one those parts make (S3 computed each part's
    crc32c of what it received). None if it is not: the object was written again in another layout since
    (a server-side copy, `aws s3 sync`, another tool), or the record is wrong, and then the value vouches
    for nothing either way; the caller reads the bytes (verify) or checks them as they are loaded. A damaged
    upload is caught when it is made (s3store's confirmation compares the parts it sent), not here.
    S3 spells the value "<b64>-<parts>" (moto's HEAD leaves the suffix off)."""
    crcs = [int(c, 16) for c in parts.crc32c]
    value, _, count = stored.partition("-")
    if value != composite_value(crcs) or (count and count != str(len(crcs))):
        return None
    lengths = [min(parts.size, size - off) for off in range(0, size, parts.size)] or [0]
    return combine(list(zip(crcs, lengths, strict=True)))


def composite(head: dict[str, Any]) -> bool:
    crc = head.get("ChecksumCRC32C")
    return head.get("ChecksumType") == "COMPOSITE" or (isinstance(crc, str) and "-" in crc)
