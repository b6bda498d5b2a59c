"""GCS through gcsfs with the requests a checkpoint needs and no more.

The generic store (upload.py) asks fsspec, and gcsfs answers a stat (``info``) with an object GET raced
against a listing of the path as a "directory" (a GET and a listing at least, three requests where the
object exists), and a copy (``copy``) with path expansion (two such stats) before the rewrite. A
checkpoint's paths are always objects, never directories, so one object GET answers the stat (size and
the crc32c GCS computed of the bytes it holds: the same answer ``info`` returns) and one rewrite makes the
copy. What is proven of an object does not change: the crc32c is GCS's own either way (docs/storage.md).

Writes of up to one part (``TransferOptions.part_size``: every manifest, record and small checkpoint file)
are one simple upload, whose answer is the object's resource with the crc32c GCS computed of the bytes it
stored: compared with ours there, the object is confirmed by the answer (remote/confirmed.py: the commit
does not ask again), and a different value is sent again (``DamagedInTransit``). gcsfs's own stream would
start a resumable upload for them (two requests) and confirm nothing. A longer stream goes on through
gcsfs's stream, and the commit confirms it by a stat.
"""

from __future__ import annotations

from typing import Any

import crc32c
from fsspec.asyn import sync
from fsspec.caching import caches

from safepoint.remote.rawwriter import FsWriter, RawWriter
from safepoint.remote.retry import DamagedInTransit, UploadError, retry
from safepoint.remote.upload import FileCopy, ObjectStore, check_local, hex_crc, read_range
from safepoint.store.checksum import crc_hex
from safepoint.store.manifest import Parts


class GcsStore(ObjectStore):
    """ObjectStore for gcsfs.GCSFileSystem: stats and copies in one request each."""

    def _run(self, fn: Any, *args: Any) -> Any:
        return sync(self.fs.loop, fn, *args)

    def stored_checksum(self, path: str, parts: Parts | None = None) -> tuple[int, str | None]:
        self.fs.invalidate_cache(path)  # gcsfs answers from its listing cache where it holds one
        try:
            info = retry(f"stat of {self.url(path)}", lambda: self._run(self.fs._get_object, path), self.cfg)
        except UploadError as e:
            if isinstance(e.__cause__, FileNotFoundError):
                raise e.__cause__ from None
            raise
        crc = info.get("crc32c")  # base64 crc32c of every object
        return int(info.get("size") or 0), hex_crc(crc) if isinstance(crc, str) else None

    def copy(self, src: str, dst: str, size: int | None = None, crc: str | None = None) -> None:
        """A rewrite (server-side; gcsfs repeats it with GCS's token until GCS reports it done), proven
        afterwards by the caller from the copy's crc32c, which GCS computes (incremental_copy.proven_copy)."""
        retry(f"copy of {self.url(src)}", lambda: self._run(self.fs._cp_file, src, dst), self.cfg)
        self.fs.invalidate_cache(dst)

    def open_read(self, path: str, *, block_size: int, cache_type: str = "readahead") -> Any:
        """A reader of ``path``: its size from one stat, its bytes in ranged reads through fsspec's cache.
        gcsfs's own file stats the object with ``info`` whatever size it is given (two or three requests,
        as the race goes) and caches nothing unless told."""
        size = self.stored_checksum(path)[0]

        def fetch(start: int, end: int) -> bytes:
            what = f"read of {self.url(path)}"
            try:
                return bytes(retry(what, lambda: self._run(self.fs._cat_file, path, start, end), self.cfg))
            except UploadError as e:  # a failed read, as a file's (the restore falls back on OSError)
                raise OSError(str(e)) from e

        return _RangedReader(caches[cache_type](block_size, fetch, size), size)

    def put_bytes(self, path: str, data: bytes, *, if_absent: bool = False) -> None:
        if if_absent:
            raise NotImplementedError("gs:// creates conditionally through remote/conditional.py")
        self.upload(path, data)

    def upload(self, path: str, data: bytes) -> None:
        """One simple upload of ``data`` to ``path``, confirmed by GCS's answer (the module docstring)."""
        from gcsfs.core import simple_upload

        bucket, key, _ = self.fs.split_path(path)
        crc = crc_hex(crc32c.crc32c(data))
        self.confirmed.forget(path)

        def once() -> None:
            answer = self._run(simple_upload, self.fs, bucket, key, data)
            got = (int(answer.get("size") or -1), hex_crc(str(answer.get("crc32c"))))
            if got != (len(data), crc):
                raise DamagedInTransit(
                    f"GCS stored {got[0]} bytes of crc32c {got[1]}; sent {len(data)}, {crc}"
                )

        retry(f"write of {self.url(path)}", once, self.cfg)
        self.confirmed.remember(path, len(data), crc)
        self.fs.invalidate_cache(path)

    def put_file(self, item: FileCopy) -> None:
        """A file of up to one part: one upload confirmed by its answer; a longer one as any store's."""
        if item.size > self.cfg.part_size:
            super().put_file(item)
            return
        self.pass_gate()
        try:
            data, crc = read_range(item.local, 0, item.size, item.root)
        except EOFError as e:
            raise UploadError(f"upload of {item.local}: {e}") from None
        check_local(item, crc_hex(crc))  # a local file that changed since its manifest is not uploaded
        self.upload(item.remote, data)

    def open_writer(self, path: str) -> RawWriter:
        return _GcsWriter(self, path)


class _GcsWriter(RawWriter):
    """Up to one part buffered and sent as one confirmed upload at close; past that, gcsfs's stream."""

    def __init__(self, store: GcsStore, path: str) -> None:
        self._s, self._path = store, path
        self._buf: bytearray | None = bytearray()
        self._stream: RawWriter | None = None

    def write(self, data: Any) -> int:
        n = len(memoryview(data))
        if self._buf is not None and len(self._buf) + n <= self._s.cfg.part_size:
            self._buf += data
            return n
        if self._stream is None:
            self._stream = FsWriter(self._s.fs, self._path)
            self._stream.write(bytes(self._buf or b""))
            self._buf = None
        return self._stream.write(data)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        elif self._buf is not None:
            data, self._buf = bytes(self._buf), None
            self._s.upload(self._path, data)

    def abort(self) -> None:
        self._buf = None  # nothing was sent: nothing appears
        if self._stream is not None:
            self._stream.abort()


class _RangedReader:
    """What the checked reader (io.SafeStoreReader) uses of a file: ``size``, ``seek``, ``read``."""

    def __init__(self, cache: Any, size: int) -> None:
        self._cache, self.size, self._at = cache, size, 0

    def seek(self, offset: int) -> None:
        self._at = offset

    def read(self, length: int) -> bytes:
        data = self._cache._fetch(self._at, min(self._at + length, self.size))
        self._at += len(data)
        return bytes(data)

    def __enter__(self) -> _RangedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        pass
