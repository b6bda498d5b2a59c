"""The streaming write in parts that S3 (multipart upload) and Azure (blocks) share: DCP's writer with no
local tier writes into it, and parts go up while DCP is still writing.

Every full ``part_size`` of bytes goes up at once, at most ``concurrency`` parts per file in flight, so
memory stays bounded; ``close`` sends the rest and makes the object (a file smaller than one part is a
single request); ``abort`` drops everything, so no object appears. The store's requests are the hooks
a subclass fills in: ``_begin`` (before the first part), ``_part`` (one part, on the event loop),
``_whole`` (a file of less than one part), ``_finish`` (assemble the parts) and ``_drop`` (abort).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import crc32c

from safepoint.remote.retry import DamagedInTransit, UploadError
from safepoint.remote.upload import RawWriter, StreamWriteError


class PartWriter(RawWriter):
    """Buffer, send full parts concurrently (bounded), finish or abort; see the module's docstring."""

    def __init__(self, loop: asyncio.AbstractEventLoop, part_size: int, concurrency: int, what: str) -> None:
        self._loop, self._part_size, self._concurrency, self._what = loop, part_size, concurrency, what
        self._buf = bytearray()
        self._parts: list[concurrent.futures.Future[Any]] = []
        self._crcs: list[tuple[int, int]] = []
        """Each part's (crc32c, length), in order."""
        self._done = False

    # ---- what a store fills in --------------------------------------------------------------------------

    def _begin(self) -> None:
        """Before the first part is sent (S3: create the multipart upload)."""

    async def _part(self, n: int, data: bytes, crc: int) -> Any:
        """Send part ``n`` (1-based) with its crc32c; what it returns goes to ``_finish``."""
        raise NotImplementedError

    def _whole(self, data: bytes) -> None:
        """Make the object from ``data``, less than one part, in one request."""
        raise NotImplementedError

    def _finish(self, sent: list[Any]) -> None:
        """Make the object from the parts sent (``_part``'s results in order; ``_crcs`` has their crc32c)."""
        raise NotImplementedError

    def _drop(self) -> None:
        """Abort after ``_begin``: nothing of the parts may become an object."""

    # ---- the stream -------------------------------------------------------------------------------------

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._buf += view
        while len(self._buf) >= self._part_size:
            chunk = bytes(self._buf[: self._part_size])
            del self._buf[: self._part_size]
            self._send(chunk)
        return view.nbytes

    def _send(self, chunk: bytes) -> None:
        try:
            if not self._parts:
                self._begin()
            in_flight = [f for f in self._parts if not f.done()]
            while len(in_flight) >= self._concurrency:
                concurrent.futures.wait(in_flight, return_when=concurrent.futures.FIRST_COMPLETED)
                in_flight = [f for f in self._parts if not f.done()]
            for f in self._parts:
                if f.done() and (e := f.exception()) is not None:
                    raise e
        except UploadError as e:  # an OSError too: see StreamWriteError
            raise StreamWriteError(str(e)) from e
        except Exception as e:
            raise StreamWriteError(f"{self._what}: {e}") from e
        crc = crc32c.crc32c(chunk)
        self._crcs.append((crc, len(chunk)))
        coro = self._part(len(self._parts) + 1, chunk, crc)
        self._parts.append(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def close(self) -> None:
        if self._done:
            return
        try:
            if not self._parts:
                self._whole(bytes(self._buf))
            else:
                if self._buf:
                    self._send(bytes(self._buf))
                self._finish([f.result() for f in self._parts])
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
        self._drop()
