"""GCS through gcsfs with the requests a checkpoint needs and no more.

The generic store (upload.py) asks fsspec, and gcsfs answers a stat (``info``) with an object GET raced
against a listing of the path as a "directory" (a GET and a listing at least, three requests where the
object exists), and a copy (``copy``) with path expansion (two such stats) before the rewrite. A
checkpoint's paths are always objects, never directories, so one object GET answers the stat (size and
the crc32c GCS computed of the bytes it holds: the same answer ``info`` returns) and one rewrite makes the
copy. What is proven of an object does not change: the crc32c is GCS's own either way (docs/storage.md).
"""

from __future__ import annotations

from typing import Any

from fsspec.asyn import sync

from safepoint.remote.retry import UploadError, retry
from safepoint.remote.upload import ObjectStore, hex_crc
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
