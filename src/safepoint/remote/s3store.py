"""S3 transfers that the store itself verifies: CRC32C checksums, multipart, conditional creates.

Every object goes up with the crc32c that DCP's write stream recorded for it (``ChecksumCRC32C``); S3
recomputes it over the bytes it received and rejects a mismatch (``BadDigest``). Big files go up as
multipart uploads with a per-part CRC32C. Uploads of local files complete with S3's *composite* CRC32C
(crc32c of the parts' crc32cs) and return their parts, which the manifest records so that a later verify
needs no download (s3read.vouched); streamed writes (s3writer.py) complete with a *full-object* CRC32C
(``ChecksumType=FULL_OBJECT``), which S3 checks against the assembled object (``TransferOptions.
full_object_checksum`` chooses otherwise). Before completing, the parts' checksums are combined locally and
compared with the manifest: a local file that changed or rotted since it was written is never uploaded.
After the upload the store's answer, or else a HEAD with ``ChecksumMode=ENABLED``, confirms the checksum;
where it keeps none, the ETag the bytes sent make or a read back does (s3read.py ``settle``), never size.

The requests go straight to s3fs's aiobotocore client (credentials, endpoint, region and extra request
arguments all come from s3fs), bypassing s3fs's own retry wrapper so that one retry policy
(``TransferOptions``) with backoff and jitter governs them. botocore's own retries (``config_kwargs=
{"retries": ...}``) still happen inside each attempt.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from typing import Any, TypeVar

import crc32c

from safepoint.remote.retry import DamagedInTransit, UploadError, cause_code
from safepoint.remote.s3copy import copy_in_parts
from safepoint.remote.s3read import MD5, S3Reader, composite, composite_value, sent_etag
from safepoint.remote.upload import FileCopy, b64_crc, check_local, combine, hex_crc, read_range
from safepoint.store.checksum import crc_hex
from safepoint.store.manifest import Parts

log = logging.getLogger("safepoint")
T = TypeVar("T")
_MAX_PARTS = 10_000
_MAX_COPY = 5 * 1024**3  # CopyObject's limit; bigger objects are copied in parts (s3copy.py)


# Where the next page of a multipart-upload listing starts: the request's parameter, the answer's field.
_PAGE_MARKERS = (("KeyMarker", "NextKeyMarker"), ("UploadIdMarker", "NextUploadIdMarker"))


class S3Store(S3Reader):
    """ObjectStore for s3fs.S3FileSystem: the writes (the requests, retries and reads: s3read.py)."""

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
        self.confirmed.forget(path)
        try:
            answer = self.run(
                self.aretry, f"write of {self.url(path)}", lambda: self._put(bucket, key, data, crc, cond)
            )
        except UploadError as e:
            if cause_code(e) in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise FileExistsError(self.url(path)) from e
            raise
        if isinstance(answer, dict) and hex_crc(str(answer.get("ChecksumCRC32C"))) == crc:  # S3's own
            self.confirmed.remember(path, len(data), crc)  # CRC32C of what it stored: the commit need not ask
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

    def copy(self, src: str, dst: str, size: int | None = None, crc: str | None = None) -> None:
        """CopyObject (UploadPartCopy parts above 5 GiB, s3copy.py). Where the store keeps no CRC32C and
        ``src`` is a version this process proved to hold ``size`` bytes of crc32c ``crc`` (remote/
        versions.py), the copy is made on the condition ``CopySourceIfMatch`` = that version's ETag (S3
        refuses another: UploadError) and the copy's own version is remembered as proven in turn."""
        source = self.versions.tag(src, size, crc) if size is not None and crc is not None else None
        self.versions.forget(dst)
        if size is not None and size > _MAX_COPY:
            tag = self.run(copy_in_parts, self, src, dst, size, crc, source)
            answer: Any = {"ETag": tag}
        else:
            sb, sk = self._split(src)
            db, dk = self._split(dst)
            cond = {"CopySourceIfMatch": source} if source is not None else {}
            # ChecksumAlgorithm: S3 computes the copy's CRC32C itself, so prove() can compare it with
            # ``crc`` (CopyObject takes no expected checksum: the comparison is the caller's).
            answer = self.run(
                self.aretry,
                f"copy of {self.url(src)}",
                lambda: self.call(
                    "copy_object",
                    Bucket=db,
                    Key=dk,
                    CopySource={"Bucket": sb, "Key": sk},
                    ChecksumAlgorithm="CRC32C",
                    **cond,
                ),
            )
        if source is not None and size is not None and crc is not None:
            result = answer.get("CopyObjectResult", answer) if isinstance(answer, dict) else {}
            if self.copied_from(src, source, result.get("ETag")):
                self.versions.remember(dst, result.get("ETag"), size, crc)  # the copy's own version
        self.fs.invalidate_cache(dst)

    def delete(self, paths: Sequence[str]) -> None:
        """DeleteObjects, 1000 keys a request, checking every key's outcome: S3 answers 200 even when some
        keys failed (s3fs's ``rm`` ignores those), and a manifest whose delete silently failed would stay
        listed over deleted data. A retry resends the whole batch (deleting a deleted key is a no-op)."""
        keys: dict[str, list[str]] = {}
        for path in paths:
            bucket, key = self._split(path)
            keys.setdefault(bucket, []).append(key)
        for bucket, names in keys.items():
            for i in range(0, len(names), 1000):
                batch = names[i : i + 1000]
                what = f"delete of {len(batch)} objects from {self.url(bucket)}"
                self.run(self.aretry, what, functools.partial(self._delete, bucket, batch))
        self.fs.invalidate_cache()

    async def _delete(self, bucket: str, keys: list[str]) -> None:
        objects = {"Objects": [{"Key": k} for k in keys], "Quiet": True}
        r = await self.call("delete_objects", Bucket=bucket, Delete=objects)
        if failed := [e for e in r.get("Errors", []) if e.get("Code") != "NoSuchKey"]:
            raise KeyDeleteError(failed)

    # ---- files ------------------------------------------------------------------------------------------

    def put_files(self, items: Sequence[FileCopy]) -> dict[str, Parts]:
        done = self.run(self._put_all, items)
        self.fs.invalidate_cache()
        return done

    async def _put_all(self, items: Sequence[FileCopy]) -> dict[str, Parts]:
        """Small files all at once; big files one after another, each with every slot for its parts.

        One big file keeps ``concurrency`` requests busy by itself. Finishing files one by one instead of
        interleaving all of them keeps fewer multipart uploads open (less state held by the store, and
        less to abort) at the same request concurrency. The next file starts once a file's parts are all
        sent: its completion and confirmation (two round trips) overlap the next file's parts.
        """
        small = [i for i in items if i.size <= self.cfg.part_size]
        big = sorted((i for i in items if i.size > self.cfg.part_size), key=lambda i: i.remote)
        parts: dict[str, Parts] = {}

        async def big_ones() -> None:
            tasks: list[asyncio.Task[Parts | None]] = []
            try:
                for item in big:
                    sent = asyncio.Event()
                    tasks.append(asyncio.create_task(self._put_file(item, sent)))
                    waiter = asyncio.create_task(sent.wait())
                    try:
                        await asyncio.wait([tasks[-1], waiter], return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        waiter.cancel()
                    if tasks[-1].done():
                        tasks[-1].result()  # a failure stops here: start no further file
                for item, task in zip(big, tasks, strict=True):
                    if (p := await task) is not None:
                        parts[item.remote] = p
            except BaseException:
                for task in tasks:  # their multipart uploads are aborted as they are cancelled
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

        await self._gather([big_ones(), *(self._put_file(i) for i in small)])
        return parts

    def put_file(self, item: FileCopy) -> None:
        self.put_files([item])

    async def _put_file(self, item: FileCopy, sent: asyncio.Event | None = None) -> Parts | None:
        # The whole file again if the store holds other bytes than were sent (DamagedInTransit).
        what = f"upload of {item.local} to {self.url(item.remote)}"
        return await self.aretry(what, lambda: self._put_file_once(item, what, sent or asyncio.Event()))

    async def _put_file_once(self, item: FileCopy, what: str, sent: asyncio.Event) -> Parts | None:
        """Upload one file (``sent`` is set once its bytes are all sent); the parts it went up in when its
        stored checksum is a composite one (the manifest records them, so that the object can be verified
        later without reading it), else None."""
        bucket, key = self._split(item.remote)
        self.versions.forget(item.remote)
        # Deterministic parts (the configured size, or more for a file of over 10,000 of them).
        psize = max(self.cfg.part_size, -(-item.size // _MAX_PARTS))
        full = self.cfg.full_object_checksum is True
        part_crcs: list[int] = []
        md5s: list[bytes | None] = []
        if item.size <= psize:
            async with self.sem:
                await self._gate()
                data, crc = await self._in_pool(read_range, item.local, 0, item.size, item.root)
                check_local(item, crc_hex(crc))
                answer = await self.aretry(what, lambda: self._put(bucket, key, data, item.crc32c, {}))
                md5s = [await self.answer_md5(answer, data)]
            sent.set()
        else:
            upload_id = await self.create_mpu(bucket, key, what, full=full)
            try:

                async def part(n: int, off: int) -> tuple[dict[str, Any], int, int]:
                    length = min(psize, item.size - off)
                    async with self.sem:
                        await self._gate()
                        data, crc = await self._in_pool(read_range, item.local, off, length, item.root)
                        return await self.send_part(bucket, key, upload_id, n, data, crc, what), crc, length

                done = await self._gather(
                    [part(i + 1, off) for i, off in enumerate(range(0, item.size, psize))]
                )
                sent.set()
                part_crcs = [crc for _, crc, _ in done]
                md5s = [p.get(MD5) for p, _, _ in done]
                check_local(item, combine([(crc, n) for _, crc, n in done]))
                answer = await self.complete_mpu(
                    bucket, key, upload_id, [p for p, _, _ in done], item.crc32c, what, full=full
                )
            except BaseException:
                await self.abort_mpu(bucket, key, upload_id)
                raise
        parts = None if full or not part_crcs else Parts(size=psize, crc32c=tuple(map(crc_hex, part_crcs)))
        if not answer_confirms(answer, item.crc32c, part_crcs if parts else None):  # (None: answer lost)
            tag = sent_etag(md5s, bool(part_crcs))
            await self.aconfirm(item.remote, item.size, item.crc32c, what, part_crcs, tag)
        return parts

    async def create_mpu(self, bucket: str, key: str, what: str, *, full: bool) -> str:
        r = await self.aretry(
            what,
            lambda: self.call(
                "create_multipart_upload",
                Bucket=bucket,
                Key=key,
                ChecksumAlgorithm="CRC32C",
                # Explicit either way: a HEAD then says which kind the stored checksum is.
                ChecksumType="FULL_OBJECT" if full else "COMPOSITE",
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
        md5 = await self.answer_md5(r, data)
        return {"PartNumber": n, "ETag": r["ETag"], "ChecksumCRC32C": b64, **({MD5: md5} if md5 else {})}

    async def complete_mpu(
        self,
        bucket: str,
        key: str,
        upload_id: str,
        parts: list[dict[str, Any]],
        crc: str | None,
        what: str,
        *,
        full: bool,
    ) -> Any:
        """Complete the upload (``full``: with the full-object CRC32C ``crc``, which S3 checks, or without a
        client value where ``crc`` is None, S3 then only computing its own); the store's answer (None if a
        retry found it already completed). Uploads (s3store, s3writer) and multipart copies (s3copy) alike
        complete here, so a completion whose answer was lost is handled the same way for all of them."""
        whole: dict[str, str] = {"ChecksumType": "FULL_OBJECT"} if full else {}
        if full and crc is not None:
            whole["ChecksumCRC32C"] = b64_crc(crc)

        async def complete() -> Any:
            try:
                return await self.call(
                    "complete_multipart_upload",
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": [{k: v for k, v in p.items() if k != MD5} for p in parts]},
                    **whole,
                )
            except Exception as e:
                # A retry after a completion whose answer was lost: the upload is gone because it
                # finished. The caller's HEAD then decides from the object itself (an upload that is gone
                # for another reason leaves no object, or one of other bytes: refused there). Even on our
                # first attempt: botocore retries a reset connection itself, inside that attempt.
                if cause_code(e) == "NoSuchUpload":
                    return None
                raise

        return await self.aretry(f"{what} (complete)", complete)

    async def abort_mpu(self, bucket: str, key: str, upload_id: str) -> None:
        try:
            await self.call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception as e:  # parts left behind cost storage only; bucket lifecycle rules expire them
            log.warning("safepoint: could not abort multipart upload of %s/%s: %s", bucket, key, e)

    def abort_uploads(self, prefix: str) -> int:
        """Abort the multipart uploads left open under ``prefix`` (by a killed writer: the owner calls this
        before it uploads anything itself). Their parts are invisible but billed until then."""
        bucket, key = self._split(prefix)
        # A root at the bucket's top owns every key of it: no prefix (not "/", which no key starts with).
        under = key.strip("/") + "/" if key.strip("/") else ""

        async def abort_all() -> int:
            aborted, markers = 0, dict[str, str]()
            while True:  # a listing holds at most 1,000 uploads: every page, each from where the last ended
                r = await self.call("list_multipart_uploads", Bucket=bucket, Prefix=under, **markers)
                for up in r.get("Uploads", []):
                    await self.abort_mpu(bucket, up["Key"], up["UploadId"])
                aborted += len(r.get("Uploads", []))
                after = {name: str(r[field]) for name, field in _PAGE_MARKERS if r.get(field)}
                if not r.get("IsTruncated") or "KeyMarker" not in after or after == markers:
                    return aborted  # (a truncated page that names no new place to go on from ends it too)
                markers = after

        return int(self.run(self.aretry, f"listing of open uploads under {self.url(prefix)}", abort_all))

    async def aconfirm(
        self, path: str, size: int, crc: str, what: str, parts: Sequence[int] = (), sent: str | None = None
    ) -> None:
        """HEAD the object: its size, and its CRC32C against ``crc`` (or, for a composite checksum, against
        the one ``parts``' checksums make: crc32c of their big-endian bytes, "-<number of parts>"); where
        the store reports none, its ETag against ``sent``, else read back (``S3Reader.settle``)."""
        bucket, key = self._split(path)
        head = await self.aretry(f"{what} (confirm)", lambda: self._head(bucket, key))
        if int(head["ContentLength"]) != size:
            raise UploadError(f"{what}: the store holds {head['ContentLength']} bytes, expected {size}")
        stored = head.get("ChecksumCRC32C")
        if composite(head) and isinstance(stored, str) and parts:
            # S3 spells it "<b64>-<parts>" (moto's HEAD leaves the suffix off): compare the value part.
            expected = composite_value(parts)
            if str(stored).split("-")[0] != expected:
                raise DamagedInTransit(f"the store reports composite crc32c {stored}, expected {expected}")
        elif (value := hex_crc(stored) if isinstance(stored, str) and not composite(head) else None) is None:
            await self.settle(path, head, size, crc, sent, what)
            return
        elif value != crc:
            raise DamagedInTransit(f"the store reports crc32c {value}, expected {crc}")
        self.versions.forget(path)  # S3's own CRC32C proves it: no version is remembered


class KeyDeleteError(Exception):
    """Keys a DeleteObjects answered 200 but did not delete, shaped like botocore's ClientError (retry.py)."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        first = errors[0]
        message = f"{first.get('Key')}: {first.get('Message', '')} ({len(errors)} key(s) not deleted)"
        self.response = {"Error": {"Code": first.get("Code", ""), "Message": message}}
        super().__init__(f"{first.get('Code')}: {message}")


def answer_confirms(answer: Any, crc: str, parts: Sequence[int] | None) -> bool:
    """Whether a PUT's or a multipart completion's answer already confirms the object: it carries the
    CRC32C the store holds for it, equal to ours: the full-object one, or (``parts``: a composite upload)
    the composite one those parts make. S3 computes those values from the bytes it received (and refuses a
    request whose checksum differs), so the HEAD that would report the same value is one round trip per
    object saved. Anything else (no checksum in the answer, another kind than expected, a retried
    completion whose answer was lost) is confirmed by a HEAD. A different value raises."""
    if not isinstance(answer, dict) or not isinstance(stored := answer.get("ChecksumCRC32C"), str):
        return False
    kind = answer.get("ChecksumType", "COMPOSITE" if "-" in stored else "FULL_OBJECT")
    if parts is not None:
        if kind != "COMPOSITE":
            return False
        b64, _, count = stored.partition("-")
        if b64 != composite_value(parts) or (count and count != str(len(parts))):
            raise DamagedInTransit(
                f"the store reports composite crc32c {stored}, expected {composite_value(parts)}"
            )
        return True
    if kind != "FULL_OBJECT":
        return False
    value = hex_crc(stored)
    if value is not None and value != crc:
        raise DamagedInTransit(f"the store reports crc32c {value}, expected {crc}")
    return value is not None
