"""Streaming writes straight to S3 (DCP's writer with no local tier): multipart while DCP still writes.

Parts of ``part_size`` go up as soon as they are full, at most ``concurrency`` per file in flight (memory
stays bounded), each with its CRC32C; close completes the upload with the full-object CRC32C and confirms
it with a HEAD. A file smaller than one part is a single PUT. ``abort`` drops everything: no object appears.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from typing import Any

import crc32c

from safepoint.remote.retry import DamagedInTransit, UploadError
from safepoint.remote.s3store import S3Store
from safepoint.remote.upload import ObjectStore, RawWriter, StreamWriteError, combine
from safepoint.store.checksum import crc_hex


class S3Writer(RawWriter):
    """Parts go up while DCP is still writing: memory stays at ``concurrency`` parts per file."""

    def __init__(self, store: S3Store, path: str) -> None:
        self._s, self._path = store, path
        self._bucket, self._key = store._split(path)
        self._what = f"upload of {store.url(path)}"
        self._buf = bytearray()
        self._parts: list[concurrent.futures.Future[dict[str, Any]]] = []
        self._crcs: list[tuple[int, int]] = []
        self._upload_id: str | None = None
        self._done = False
        # Full-object unless asked otherwise: a streamed file's parts are not recorded in the manifest (the
        # rank's file list carries size and crc32c only), so a composite value could not be checked later.
        self._full = store.cfg.full_object_checksum is not False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._buf += view
        size = self._s.cfg.part_size
        try:
            while len(self._buf) >= size:
                chunk = bytes(self._buf[:size])
                del self._buf[:size]
                self._send(chunk)
        except UploadError as e:
            raise StreamWriteError(str(e)) from e
        return view.nbytes

    def _send(self, chunk: bytes) -> None:
        s = self._s
        if self._upload_id is None:
            self._upload_id = s.run(
                functools.partial(s.create_mpu, self._bucket, self._key, self._what, full=self._full)
            )
        in_flight = [f for f in self._parts if not f.done()]
        while len(in_flight) >= s.cfg.concurrency:
            concurrent.futures.wait(in_flight, return_when=concurrent.futures.FIRST_COMPLETED)
            in_flight = [f for f in self._parts if not f.done()]
        for f in self._parts:
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        crc = crc32c.crc32c(chunk)
        self._crcs.append((crc, len(chunk)))
        n, upload_id = len(self._parts) + 1, self._upload_id

        async def part() -> dict[str, Any]:
            async with s.sem:
                return await s.send_part(self._bucket, self._key, upload_id, n, chunk, crc, self._what)

        self._parts.append(asyncio.run_coroutine_threadsafe(part(), s.fs.loop))

    def close(self) -> None:
        if self._done:
            return
        s = self._s
        try:
            if self._upload_id is None:
                data = bytes(self._buf)
                crc = crc_hex(crc32c.crc32c(data))
                s.run(s.aretry, self._what, lambda: s._put(self._bucket, self._key, data, crc, {}))
            else:
                if self._buf:
                    self._send(bytes(self._buf))
                parts = [f.result() for f in self._parts]
                crc = combine(self._crcs)
                complete = functools.partial(s.complete_mpu, full=self._full)
                s.run(complete, self._bucket, self._key, self._upload_id, parts, crc, self._what)
            size = sum(n for _, n in self._crcs) if self._upload_id else len(self._buf)
            s.run(s.aconfirm, self._path, size, crc, self._what, [c for c, _ in self._crcs])
            self._done = True
        except DamagedInTransit as e:  # streamed: nothing to resend from; the save fails, uncommitted
            self.abort()
            raise StreamWriteError(f"{self._what}: {e}") from e
        except BaseException:
            self.abort()
            raise
        finally:
            self._buf = bytearray()

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        for f in self._parts:
            f.cancel()
        concurrent.futures.wait(self._parts)
        if self._upload_id is not None:
            self._s.run(self._s.abort_mpu, self._bucket, self._key, self._upload_id)


def open_writer(store: ObjectStore, path: str) -> RawWriter:
    """The stream DCP writes one file into: multipart while DCP writes on S3, the store's own elsewhere.

    Here rather than as an S3Store method: S3Writer needs S3Store's requests, so S3Store naming S3Writer
    would make the two modules import each other."""
    if isinstance(store, S3Store):
        return S3Writer(store, path)
    return store.open_writer(path)
