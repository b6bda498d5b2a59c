"""The base of ``AzureStore``: requests through adlfs's async Azure SDK client under one retry policy, and
the listings, stats and deletes a checkpoint needs, one request each.

adlfs's own ``find``, ``info`` and ``rm`` first ask whether a name is a blob or a "directory": a HEAD of
the prefix before a listing, a listing after a HEAD that finds no blob, a HEAD per path and a listing
before a delete. A checkpoint's names are always blobs and its prefixes never blobs, so those answers
are known: a listing is one List Blobs (a page per 5,000 blobs), a stat one Get Blob Properties, a delete
one Delete Blob per blob. azstore.py adds the verified writes and copies.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fsspec.asyn import sync

from safepoint.remote.retry import UploadError, lower_priority, retry_async
from safepoint.remote.upload import ObjectStore
from safepoint.remote.versions import ProvenVersions
from safepoint.store.manifest import Parts

T = TypeVar("T")


class AzureBase(ObjectStore):
    """Requests to Azure Blob through adlfs's client (AzureStore adds the writes)."""

    def __init__(self, fs: Any, cfg: Any = None) -> None:
        super().__init__(fs, cfg)
        self._sem: asyncio.Semaphore | None = None
        init = lower_priority if self.cfg.background else None
        # Reading parts from disk and hashing them (hashlib and crc32c release the GIL) off the event loop.
        self._pool = concurrent.futures.ThreadPoolExecutor(self.cfg.concurrency, initializer=init)
        self.versions = ProvenVersions()
        """The blob versions whose bytes this process proved (module docstring; remote/versions.py)."""

    # ---- plumbing ---------------------------------------------------------------------------------------

    def client(self, path: str) -> Any:
        container, _, blob = path.partition("/")
        return self.fs.service_client.get_blob_client(container, blob)

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return sync(self.fs.loop, fn, *args)  # type: ignore[no-any-return]

    async def aretry(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        return await retry_async(what, fn, self.cfg)

    @property
    def sem(self) -> asyncio.Semaphore:
        if self._sem is None:  # made on first use, inside the event loop's thread
            self._sem = asyncio.Semaphore(self.cfg.concurrency)
        return self._sem

    async def _in_pool(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ---- listings and deletes: one request each (adlfs's find and rm first ask whether names are blobs or
    # "directories": a HEAD of the prefix, and a HEAD per path and a listing per delete) ----------------

    def sizes(self, prefix: str) -> dict[str, int]:
        container, _, key = prefix.partition("/")
        key = key.rstrip("/")
        base = f"{key}/" if key else ""  # a root at the top of the bucket: every key is under it

        async def listing() -> dict[str, int]:
            from azure.core.exceptions import ResourceNotFoundError

            client = self.fs.service_client.get_container_client(container)
            blobs = client.list_blobs(name_starts_with=base, include=["metadata"])
            try:
                # (a "directory" of a hierarchical-namespace account is a blob marked so, as adlfs reads it)
                return {b.name[len(base) :]: int(b.size or 0) async for b in blobs if not _folder(b)}
            except ResourceNotFoundError:  # no container: nothing under it (check_root says why)
                return {}

        return self.run(self.aretry, f"listing of {self.url(prefix)}", listing)

    def _rm_present(self, paths: list[str]) -> None:
        async def one(path: str) -> None:
            from azure.core.exceptions import ResourceNotFoundError

            async with self.sem:
                with contextlib.suppress(ResourceNotFoundError):  # already gone counts as deleted
                    await self.client(path).delete_blob()

        self.run(self._gather, [one(p) for p in paths])
        for path in paths:
            self.fs.invalidate_cache(self.fs._parent(path))

    @staticmethod
    async def _gather(coros: list[Any]) -> None:
        await asyncio.gather(*coros)

    def stored_checksum(self, path: str, parts: Parts | None = None) -> tuple[int, str | None]:
        """(size, None): Azure keeps no crc32c of a blob (what proves one: azstore.py)."""
        from azure.core.exceptions import ResourceNotFoundError

        try:
            props = self.run(self.aretry, f"stat of {self.url(path)}", self.client(path).get_blob_properties)
        except UploadError as e:
            if isinstance(e.__cause__, ResourceNotFoundError):
                raise FileNotFoundError(self.url(path)) from None
            raise
        return int(props.size or 0), None


def _folder(blob: Any) -> bool:
    meta = {str(k).lower(): v for k, v in (getattr(blob, "metadata", None) or {}).items()}
    return bool(meta.get("is_directory") == "true" or meta.get("hdi_isfolder") == "true")
