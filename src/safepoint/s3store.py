"""S3 transfers that the store itself verifies: CRC32C checksums, multipart, conditional creates.

Every object goes up with the crc32c that DCP's write stream recorded for it (``ChecksumCRC32C``); S3
recomputes it over the bytes it received and rejects a mismatch (``BadDigest``). Big files go up as
multipart uploads with a per-part CRC32C and a *full-object* CRC32C on completion (``ChecksumType=
FULL_OBJECT``), so S3 checks the assembled object too. Before completing, the parts' checksums are
combined locally and compared with the manifest: a local file that changed or rotted since it was written
is never uploaded. After the upload a HEAD with ``ChecksumMode=ENABLED`` confirms size and checksum.

The requests go straight to s3fs's aiobotocore client (credentials, endpoint, region and extra request
arguments all come from s3fs), bypassing s3fs's own retry wrapper so that one retry policy
(``TransferConfig``) with backoff and jitter governs them. botocore's own retries (``config_kwargs=
{"retries": ...}``) still happen inside each attempt.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import crc32c
from fsspec.asyn import sync

from safepoint.checksum import crc_hex
from safepoint.retry import TransferConfig, UploadError, cause_code, lower_priority, next_delay
from safepoint.upload import FileCopy, ObjectStore, RawWriter, b64_crc, combine, hex_crc, read_range

log = logging.getLogger("safepoint")
T = TypeVar("T")
_MAX_PARTS = 10_000
_MAX_COPY = 5 * 1024**3  # CopyObject's limit; bigger objects are copied by s3fs in parts
_NOT_FOUND = ("404", "NoSuchKey", "NotFound")


class S3Store(ObjectStore):
    """ObjectStore for s3fs.S3FileSystem."""

    def __init__(self, fs: Any, cfg: TransferConfig | None = None) -> None:
        super().__init__(fs, cfg)
        self._sem: asyncio.Semaphore | None = None
        # Reading parts and their crc32c happens off the event loop (both release the GIL).
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.cfg.concurrency,
            "safepoint-s3io",
            initializer=lower_priority if self.cfg.background else None,
        )

    # ---- plumbing ---------------------------------------------------------------------------------------

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
        attempt = 0
        while True:
            attempt += 1
            try:
                return await fn()
            except Exception as e:
                await asyncio.sleep(next_delay(what, e, attempt, self.cfg))

    def _split(self, path: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(path)
        return bucket, key

    async def _gate(self) -> None:
        if not self.gate.is_set():  # a save is blocking training: wait (off the loop) until it is done
            await self._in_pool(self.gate.wait)

    async def _in_pool(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def check_root(self, path: str) -> None:
        bucket, _ = self._split(path)
        try:
            self.run(
                self.aretry, f"access to bucket {bucket!r}", lambda: self.call("head_bucket", Bucket=bucket)
            )
        except UploadError as e:
            code = cause_code(e)
            if code in ("404", "NoSuchBucket", "NotFound"):
                raise FileNotFoundError(
                    f"bucket {bucket!r} does not exist (safepoint never creates buckets)"
                ) from None
            if code in ("403", "AccessDenied"):
                raise PermissionError(f"access to bucket {bucket!r} denied (check credentials)") from None
            raise

    # ---- small objects ----------------------------------------------------------------------------------

    def put_bytes(self, path: str, data: bytes, *, if_absent: bool = False) -> None:
        bucket, key = self._split(path)
        crc = crc_hex(crc32c.crc32c(data))
        # If-None-Match: * makes S3 refuse to overwrite (conditional write), the one atomic create S3 has.
        cond = {"IfNoneMatch": "*"} if if_absent else {}
        try:
            self.run(
                self.aretry, f"write of {self.url(path)}", lambda: self._put(bucket, key, data, crc, cond)
            )
        except UploadError as e:
            if cause_code(e) in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise FileExistsError(self.url(path)) from e
            raise
        self.fs.invalidate_cache(path)

    async def _put(self, bucket: str, key: str, data: bytes, crc: str, cond: dict[str, str]) -> Any:
        return await self.call(
            "put_object",
            Bucket=bucket,
            Key=key,
            Body=data,
            ChecksumAlgorithm="CRC32C",
            ChecksumCRC32C=b64_crc(crc),
            **cond,
        )

    def get_bytes(self, path: str) -> bytes:
        bucket, key = self._split(path)

        async def get() -> bytes:
            r = await self.call("get_object", Bucket=bucket, Key=key)
            async with r["Body"] as body:
                return bytes(await body.read())

        try:
            return bytes(self.run(self.aretry, f"read of {self.url(path)}", get))
        except UploadError as e:
            if cause_code(e) in _NOT_FOUND:
                raise FileNotFoundError(self.url(path)) from None
            raise

    def stored_checksum(self, path: str) -> tuple[int, str | None]:
        bucket, key = self._split(path)
        try:
            head = self.run(self.aretry, f"stat of {self.url(path)}", lambda: self._head(bucket, key))
        except UploadError as e:
            if cause_code(e) in _NOT_FOUND:
                raise FileNotFoundError(self.url(path)) from None
            raise
        crc = head.get("ChecksumCRC32C")
        whole = isinstance(crc, str) and not _composite(head)  # a composite value is not the file's crc32c
        return int(head["ContentLength"]), hex_crc(crc) if whole else None

    async def _head(self, bucket: str, key: str) -> Any:
        return await self.call("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")

    def copy(self, src: str, dst: str, size: int | None = None) -> None:
        if size is not None and size > _MAX_COPY:
            super().copy(src, dst)
            return
        sb, sk = self._split(src)
        db, dk = self._split(dst)
        # ChecksumAlgorithm on the copy: S3 computes the copy's CRC32C itself, so confirm() can check it.
        self.run(
            self.aretry,
            f"copy of {self.url(src)}",
            lambda: self.call(
                "copy_object",
                Bucket=db,
                Key=dk,
                CopySource={"Bucket": sb, "Key": sk},
                ChecksumAlgorithm="CRC32C",
            ),
        )
        self.fs.invalidate_cache(dst)

    # ---- files ------------------------------------------------------------------------------------------

    def put_files(self, items: Sequence[FileCopy]) -> None:
        self.run(self._put_all, items)
        self.fs.invalidate_cache()

    async def _put_all(self, items: Sequence[FileCopy]) -> None:
        """Small files all at once; big files one after another, each with every slot for its parts.

        One big file keeps ``concurrency`` requests busy by itself. Finishing files one by one instead of
        interleaving all of them keeps fewer multipart uploads open (less state held by the store, and
        less to abort) at the same request concurrency.
        """
        small = [i for i in items if i.size <= self.cfg.part_size]
        big = sorted((i for i in items if i.size > self.cfg.part_size), key=lambda i: i.remote)

        async def big_ones() -> None:
            for item in big:
                await self._put_file(item)

        await self._gather([big_ones(), *(self._put_file(i) for i in small)])

    def put_file(self, item: FileCopy) -> None:
        self.put_files([item])

    async def _put_file(self, item: FileCopy) -> None:
        what = f"upload of {item.local} to {self.url(item.remote)}"
        bucket, key = self._split(item.remote)
        psize = max(self.cfg.part_size, -(-item.size // _MAX_PARTS))
        part_crcs: list[int] = []
        if item.size <= psize:
            async with self.sem:
                await self._gate()
                data, crc = await self._in_pool(read_range, item.local, 0, item.size)
                _check_local(item, crc_hex(crc))
                await self.aretry(what, lambda: self._put(bucket, key, data, item.crc32c, {}))
        else:
            upload_id = await self.create_mpu(bucket, key, what)
            try:

                async def part(n: int, off: int) -> tuple[dict[str, Any], int, int]:
                    length = min(psize, item.size - off)
                    async with self.sem:
                        await self._gate()
                        data, crc = await self._in_pool(read_range, item.local, off, length)
                        return await self.send_part(bucket, key, upload_id, n, data, crc, what), crc, length

                done = await self._gather(
                    [part(i + 1, off) for i, off in enumerate(range(0, item.size, psize))]
                )
                part_crcs = [crc for _, crc, _ in done]
                _check_local(item, combine([(crc, n) for _, crc, n in done]))
                await self.complete_mpu(bucket, key, upload_id, [p for p, _, _ in done], item.crc32c, what)
            except BaseException:
                await self.abort_mpu(bucket, key, upload_id)
                raise
        await self.aconfirm(item.remote, item.size, item.crc32c, what, part_crcs)

    async def create_mpu(self, bucket: str, key: str, what: str) -> str:
        r = await self.aretry(
            what,
            lambda: self.call(
                "create_multipart_upload",
                Bucket=bucket,
                Key=key,
                ChecksumAlgorithm="CRC32C",
                # Explicit either way: a HEAD then says which kind the stored checksum is.
                ChecksumType="FULL_OBJECT" if self.cfg.full_object_checksum else "COMPOSITE",
            ),
        )
        return str(r["UploadId"])

    async def send_part(
        self, bucket: str, key: str, upload_id: str, n: int, data: bytes, crc: int, what: str
    ) -> dict[str, Any]:
        b64 = b64_crc(crc_hex(crc))
        r = await self.aretry(
            f"{what} (part {n})",
            lambda: self.call(
                "upload_part",
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=n,
                Body=data,
                ChecksumAlgorithm="CRC32C",
                ChecksumCRC32C=b64,
            ),
        )
        return {"PartNumber": n, "ETag": r["ETag"], "ChecksumCRC32C": b64}

    async def complete_mpu(
        self, bucket: str, key: str, upload_id: str, parts: list[dict[str, Any]], crc: str, what: str
    ) -> None:
        attempts = 0
        full = (
            {"ChecksumCRC32C": b64_crc(crc), "ChecksumType": "FULL_OBJECT"}
            if self.cfg.full_object_checksum
            else {}
        )

        async def complete() -> Any:
            nonlocal attempts
            attempts += 1
            try:
                return await self.call(
                    "complete_multipart_upload",
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                    **full,
                )
            except Exception as e:
                # A retry after a completion whose answer was lost: the upload is gone because it
                # finished. aconfirm() then decides from the object itself.
                if attempts > 1 and cause_code(e) == "NoSuchUpload":
                    return None
                raise

        await self.aretry(f"{what} (complete)", complete)

    async def abort_mpu(self, bucket: str, key: str, upload_id: str) -> None:
        try:
            await self.call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception as e:  # parts left behind cost storage only; bucket lifecycle rules expire them
            log.warning("safepoint: could not abort multipart upload of %s/%s: %s", bucket, key, e)

    async def aconfirm(self, path: str, size: int, crc: str, what: str, parts: Sequence[int] = ()) -> None:
        """HEAD the object: its size, and its CRC32C against ``crc`` (or, for a composite checksum, against
        the one ``parts``' checksums make: crc32c of their big-endian bytes, "-<number of parts>")."""
        bucket, key = self._split(path)
        head = await self.aretry(f"{what} (confirm)", lambda: self._head(bucket, key))
        if int(head["ContentLength"]) != size:
            raise UploadError(f"{what}: the store holds {head['ContentLength']} bytes, expected {size}")
        stored = head.get("ChecksumCRC32C")
        if _composite(head):
            # S3 spells it "<b64>-<parts>" (moto's HEAD leaves the suffix off): compare the value part.
            joined = b"".join(c.to_bytes(4, "big") for c in parts)
            expected = b64_crc(crc_hex(crc32c.crc32c(joined)))
            if parts and str(stored).split("-")[0] != expected:
                raise UploadError(f"{what}: the store reports composite crc32c {stored}, expected {expected}")
            return
        value = hex_crc(stored) if isinstance(stored, str) else None
        if value is not None and value != crc:
            raise UploadError(f"{what}: the store reports crc32c {value}, expected {crc}")
        if value is None:
            log.debug("safepoint: %s: the store reports no full-object CRC32C; confirmed by size", what)

    # ---- reading ----------------------------------------------------------------------------------------

    async def _get_range(self, bucket: str, key: str, off: int, n: int) -> bytes:
        r = await self.call("get_object", Bucket=bucket, Key=key, Range=f"bytes={off}-{off + n - 1}")
        async with r["Body"] as body:
            data = bytes(await body.read())
        if len(data) != n:
            raise ConnectionError(f"short read: {len(data)} of {n} bytes")  # transient: retried
        return data

    def _ranges(self, size: int) -> list[tuple[int, int]]:
        p = self.cfg.part_size
        return [(off, min(p, size - off)) for off in range(0, size, p)]

    def read_crc(self, path: str, size: int) -> str:
        bucket, key = self._split(path)
        what = f"read of {self.url(path)}"

        async def one(off: int, n: int) -> tuple[int, int]:
            async with self.sem:
                data = await self.aretry(what, lambda: self._get_range(bucket, key, off, n))
                return await self._in_pool(crc32c.crc32c, data), n

        return combine(self.run(self._gather, [one(o, n) for o, n in self._ranges(size)]))

    def download(self, path: str, local: str, size: int) -> str:
        bucket, key = self._split(path)
        what = f"download of {self.url(path)}"
        fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:

            def write_at(data: bytes, off: int) -> int:
                os.pwrite(fd, data, off)
                return int(crc32c.crc32c(data))

            async def one(off: int, n: int) -> tuple[int, int]:
                async with self.sem:
                    data = await self.aretry(what, lambda: self._get_range(bucket, key, off, n))
                    return await self._in_pool(write_at, data, off), n

            crc = combine(self.run(self._gather, [one(o, n) for o, n in self._ranges(size)]))
            os.fsync(fd)
        finally:
            os.close(fd)
        return crc

    # ---- streaming writes (DCP straight to S3) ----------------------------------------------------------

    def open_writer(self, path: str) -> RawWriter:
        from safepoint.s3writer import S3Writer

        return S3Writer(self, path)

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


def _composite(head: dict[str, Any]) -> bool:
    crc = head.get("ChecksumCRC32C")
    return head.get("ChecksumType") == "COMPOSITE" or (isinstance(crc, str) and "-" in crc)


def _check_local(item: FileCopy, crc: str) -> None:
    if crc != item.crc32c:
        raise UploadError(
            f"upload of {item.local}: the local file no longer matches its manifest (crc32c {crc} != "
            f"{item.crc32c}); not uploading a damaged copy"
        )
