"""Streaming writes straight to S3 (DCP's writer with no local tier): multipart while DCP still writes.

Parts of ``part_size`` go up as soon as they are full, at most ``concurrency`` per file in flight (memory
stays bounded; the stream itself is stream.PartWriter, shared with Azure), each with its CRC32C; close
completes the upload with the full-object CRC32C. The store's answer confirms it where it carries S3's own
CRC32C of the object, equal to ours (S3 computed it of the bytes it received); only an answer without one
(a store that keeps none, a completion whose answer was lost) costs a HEAD. A file smaller than one part
is a single PUT. ``abort`` drops everything: no object appears.
"""

from __future__ import annotations

import functools
from typing import Any

import crc32c

from safepoint.remote.s3read import MD5, sent_etag
from safepoint.remote.s3store import S3Store, answer_confirms
from safepoint.remote.stream import PartWriter
from safepoint.remote.upload import ObjectStore, RawWriter, combine
from safepoint.store.checksum import crc_hex


class S3Writer(PartWriter):
    """A multipart upload fed while DCP is still writing (stream.PartWriter): memory stays at
    ``concurrency`` parts per file."""

    def __init__(self, store: S3Store, path: str) -> None:
        super().__init__(
            store.fs.loop, store.cfg.part_size, store.cfg.concurrency, f"upload of {store.url(path)}"
        )
        self._s, self._path = store, path
        self._bucket, self._key = store._split(path)
        self._upload_id: str | None = None
        # Full-object unless asked otherwise: a streamed file's parts are not recorded in the manifest (the
        # rank's file list carries size and crc32c only), so a composite value could not be checked later.
        self._full = store.cfg.full_object_checksum is not False

    def _begin(self) -> None:
        s = self._s
        s.versions.forget(self._path)
        s.confirmed.forget(self._path)
        self._upload_id = s.run(
            functools.partial(s.create_mpu, self._bucket, self._key, self._what, full=self._full)
        )

    async def _part(self, n: int, data: bytes, crc: int) -> dict[str, Any]:
        s, upload_id = self._s, self._upload_id
        assert upload_id is not None
        async with s.sem:
            return await s.send_part(self._bucket, self._key, upload_id, n, data, crc, self._what)

    # The object holds the bytes streamed in, whose crc32c (the one the manifest records) was computed as
    # they were sent; where the store keeps no CRC32C to confirm them, its ETag must be the one those bytes
    # make, or the object is read back (S3Reader.settle): a damaged or foreign object fails the save.
    def _whole(self, data: bytes) -> None:
        s, crc = self._s, crc_hex(crc32c.crc32c(data))
        s.versions.forget(self._path)
        s.confirmed.forget(self._path)
        answer = s.run(s.aretry, self._what, lambda: s._put(self._bucket, self._key, data, crc, {}))
        if not answer_confirms(answer, crc, None):  # else S3's CRC32C of what it stored is ours: no HEAD
            md5 = s.run(s.answer_md5, answer, data)
            s.run(s.aconfirm, self._path, len(data), crc, self._what, (), sent_etag([md5], multipart=False))
        s.confirmed.remember(self._path, len(data), crc)

    def _finish(self, sent: list[dict[str, Any]]) -> None:
        s, crc = self._s, combine(self._crcs)
        complete = functools.partial(s.complete_mpu, full=self._full)
        answer = s.run(complete, self._bucket, self._key, self._upload_id, sent, crc, self._what)
        size, crcs = sum(n for _, n in self._crcs), [c for c, _ in self._crcs]
        if not answer_confirms(answer, crc, None if self._full else crcs):  # None (answer lost): a HEAD
            tag = sent_etag([p.get(MD5) for p in sent], True)
            s.run(s.aconfirm, self._path, size, crc, self._what, crcs, tag)
        s.confirmed.remember(self._path, size, crc)

    def _drop(self) -> None:
        if self._upload_id is not None:
            self._s.run(self._s.abort_mpu, self._bucket, self._key, self._upload_id)


def open_writer(store: ObjectStore, path: str) -> RawWriter:
    """The stream DCP writes one file into: multipart while DCP writes on S3, the store's own elsewhere.

    Here rather than as an S3Store method: S3Writer needs S3Store's requests, so S3Store naming S3Writer
    would make the two modules import each other."""
    if isinstance(store, S3Store):
        return S3Writer(store, path)
    return store.open_writer(path)
