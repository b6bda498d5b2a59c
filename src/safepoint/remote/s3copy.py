"""S3's server-side copy of an object over CopyObject's 5 GiB limit: a multipart upload of UploadPartCopy
parts, made so that the copy can be proven equal to its source without reading it.

s3fs's own managed copy creates its upload without a checksum algorithm: the copy then has no CRC32C at
all (S3 and moto give it a CRC64NVME only), so a check of it could go by its size alone, and an incremental
save's server-side copy of a big frozen group would be listed unproven. Here the upload is created with
``ChecksumAlgorithm=CRC32C`` and ``ChecksumType=FULL_OBJECT``: S3 computes each part's CRC32C from the
source bytes it copies and combines them into the copy's full-object CRC32C.

The upload is completed through the store's one completion path (``S3Store.complete_mpu``), with the
crc32c the manifest holds for the source where the caller knows it: S3 then checks the copy against it
itself and refuses a mismatch at completion (moto does not check it; the comparison after the copy still
does, ``check`` in remote/incremental_copy.py). complete_mpu also knows a retried completion whose first
answer was lost (the retry finds ``NoSuchUpload`` because the upload finished): the copy is then confirmed
by a HEAD, not refused. A completed copy without a full-object CRC32C (a store that ignores the request)
is deleted and refused: never listed unverified.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

from safepoint.remote.retry import UploadError

T = TypeVar("T")


class _Store(Protocol):
    """What a copy needs of s3store.S3Store (a Protocol: s3store imports this module)."""

    @property
    def sem(self) -> asyncio.Semaphore: ...
    def url(self, path: str) -> str: ...
    def _split(self, path: str) -> tuple[str, str]: ...
    async def call(self, method: str, **kw: Any) -> Any: ...
    async def aretry(self, what: str, fn: Callable[[], Awaitable[T]]) -> T: ...
    async def _gather(self, coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]: ...
    async def _head(self, bucket: str, key: str) -> Any: ...
    async def create_mpu(self, bucket: str, key: str, what: str, *, full: bool) -> str: ...
    async def abort_mpu(self, bucket: str, key: str, upload_id: str) -> None: ...
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
    ) -> Any: ...
    async def _delete(self, bucket: str, keys: list[str]) -> None: ...


# A part of a copy: S3 allows 5 MiB to 5 GiB; big parts keep the requests few (a 50 GiB group: 50), and the
# store copies them concurrently (``TransferOptions.concurrency``), so a part's size costs no client time.
COPY_PART = 1024**3
_MAX_PARTS = 10_000


def copy_ranges(size: int) -> list[tuple[int, int]]:
    """(first byte, last byte) of each part of a copy of ``size`` bytes: ``COPY_PART`` each, or more for an
    object of over 10,000 of them (S3's limit), the last one shorter."""
    psize = max(COPY_PART, -(-size // _MAX_PARTS))
    return [(off, min(off + psize, size) - 1) for off in range(0, size, psize)]


async def copy_in_parts(
    store: _Store, src: str, dst: str, size: int, crc: str | None = None, source: str | None = None
) -> str | None:
    """Copy ``src`` (``size`` bytes; ``crc``: its crc32c as the manifest holds it, checked by S3 at
    completion) to ``dst`` by UploadPartCopy; the upload is aborted on any failure, and a completed copy
    whose full-object CRC32C the store does not report is deleted (UploadError), unless ``source`` names
    the version of ``src`` this process proved (remote/versions.py): every part is then copied on the
    condition ``CopySourceIfMatch`` = ``source``, so the copy is of that version or refused. The copy's
    ETag (None where a retried completion lost its answer)."""
    cond = {"CopySourceIfMatch": source} if source is not None else {}
    sb, sk = store._split(src)
    db, dk = store._split(dst)
    what = f"copy of {store.url(src)}"
    upload_id = await store.create_mpu(db, dk, what, full=True)
    try:

        async def part(n: int, first: int, last: int) -> dict[str, Any]:
            async with store.sem:
                r = await store.aretry(
                    f"{what} (part {n})",
                    lambda: store.call(
                        "upload_part_copy",
                        Bucket=db,
                        Key=dk,
                        UploadId=upload_id,
                        PartNumber=n,
                        CopySource={"Bucket": sb, "Key": sk},
                        CopySourceRange=f"bytes={first}-{last}",
                        **cond,
                    ),
                )
            result = r["CopyPartResult"]
            # S3 returns the part's CRC32C it computed (an upload made with a checksum algorithm needs each
            # part's at completion); moto leaves it off and computes the whole object's at completion.
            got = {"ChecksumCRC32C": result["ChecksumCRC32C"]} if "ChecksumCRC32C" in result else {}
            return {"PartNumber": n, "ETag": result["ETag"], **got}

        parts = await store._gather(
            [part(i + 1, first, last) for i, (first, last) in enumerate(copy_ranges(size))]
        )
        # None: a retry found the upload already completed (its first answer lost); the HEAD below decides.
        answer = await store.complete_mpu(db, dk, upload_id, parts, crc, what, full=True)
    except BaseException:
        await store.abort_mpu(db, dk, upload_id)
        raise
    tag = answer.get("ETag") if isinstance(answer, dict) else None
    if not _full_crc(answer) and source is None:
        head = await store.aretry(f"{what} (confirm)", lambda: store._head(db, dk))
        if not _full_crc(head):
            await store.aretry(f"delete of {store.url(dst)}", lambda: store._delete(db, [dk]))
            raise UploadError(f"{what}: the store reports no full-object CRC32C of the copy; not trusted")
    return tag if isinstance(tag, str) else None


def _full_crc(answer: Any) -> bool:
    """Whether a completion's (or a HEAD's) answer carries a full-object CRC32C (check() compares it)."""
    if not isinstance(answer, dict) or not isinstance(stored := answer.get("ChecksumCRC32C"), str):
        return False
    return bool(answer.get("ChecksumType", "COMPOSITE" if "-" in stored else "FULL_OBJECT") == "FULL_OBJECT")
