"""One small object written only under conditions: create if absent, replace or delete if unchanged.

This is what a lease needs from a store (remote/object_lease.py), and every store safepoint knows offers it:

- S3: ``If-None-Match: *`` creates, ``If-Match: <etag>`` replaces (conditional writes);
- GCS: ``ifGenerationMatch=0`` creates, ``ifGenerationMatch=<generation>`` replaces and deletes (the
  generation is a number GCS gives each version of an object);
- Azure Blob: ``If-None-Match: *`` creates, ``If-Match: <etag>`` replaces and deletes.

Each request is retried on transient errors (retry.py); a request refused by its condition raises
:class:`Conflict` at once. ``read`` also returns the object's age on the *store's* clock (its Date header
minus the object's last modification), so judging a lease stale never depends on two hosts' clocks agreeing;
both are whole seconds, so the age reported is their difference less one second: never more than the true
age (a lease is never judged stale early). ``read`` fetches at most ``limit + 1`` bytes (a ranged read): a
huge object at the key (hostile, or not ours) is never downloaded whole.
"""

from __future__ import annotations

import abc
import datetime
import email.utils
import json
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import quote

from safepoint.remote.retry import UploadError, cause_code, retry
from safepoint.remote.upload import ObjectStore

T = TypeVar("T")
_S3_CONFLICT = ("PreconditionFailed", "ConditionalRequestConflict")


class Conflict(Exception):
    """The store refused the write or delete: the object exists, or it changed (or vanished) since read."""


HTTP_DATE_RESOLUTION_S = 1.0
"""``Date`` and ``Last-Modified`` are whole seconds (RFC 9110): each may stand up to this much before the
moment it names, so their difference may exceed the true age by as much."""


def _age(date: str | None, modified: float) -> float:
    """The object's age on the store's clock, never more than the true one (module docstring)."""
    now = email.utils.parsedate_to_datetime(date).timestamp() if date else time.time()
    return max(0.0, now - modified - HTTP_DATE_RESOLUTION_S)


class CondObject(abc.ABC):
    """One object under conditional writes; ``version`` is the store's token for one state of it."""

    def __init__(self, store: ObjectStore, path: str) -> None:
        self.store, self.path = store, path

    def url(self) -> str:
        return self.store.url(self.path)

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        """``fn`` retried on transient errors; a Conflict passes through at once (never retried)."""
        conflict: list[Conflict] = []

        def once() -> T:
            try:
                return fn()
            except Conflict as e:
                conflict.append(e)
                raise UploadError(str(e)) from e  # not transient: retry() gives up at once

        try:
            return retry(f"{what} {self.url()}", once, self.store.cfg)
        except UploadError:
            if conflict:
                raise conflict[-1] from None
            raise

    @abc.abstractmethod
    def read(self, limit: int) -> tuple[bytes, str, float] | None:
        """(contents, version, age in seconds on the store's clock), or None if there is no object. Only the
        first ``limit + 1`` bytes at most: longer contents than ``limit`` mean the object is bigger."""

    @abc.abstractmethod
    def create(self, data: bytes) -> str:
        """Create the object unless it exists (Conflict); its version."""

    @abc.abstractmethod
    def replace(self, data: bytes, version: str) -> str:
        """Overwrite the object if it is still at ``version`` (Conflict otherwise); the new version."""

    @abc.abstractmethod
    def delete(self, version: str) -> None:
        """Delete the object if it is still at ``version`` (Conflict if it changed; gone already: done)."""


class S3Object(CondObject):
    def __init__(self, store: Any, path: str) -> None:
        super().__init__(store, path)
        self.bucket, self.key = store._split(path)

    def _call(self, what: str, method: str, **kw: Any) -> Any:
        s = self.store
        try:
            return s.run(s.aretry, f"{what} {self.url()}", lambda: s.call(method, **kw))  # type: ignore[attr-defined]
        except UploadError as e:
            if cause_code(e) in _S3_CONFLICT:
                raise Conflict(self.url()) from e
            raise

    def read(self, limit: int) -> tuple[bytes, str, float] | None:
        s = self.store
        where = {"Bucket": self.bucket, "Key": self.key}

        async def get() -> tuple[bytes, str, float]:
            try:
                r = await s.call("get_object", **where, Range=f"bytes=0-{limit}")  # type: ignore[attr-defined]
            except Exception as e:
                if cause_code(e) != "InvalidRange":
                    raise
                r = await s.call("head_object", **where)  # type: ignore[attr-defined]  # empty: no byte 0
                data = b""
            else:
                async with r["Body"] as body:
                    data = bytes(await body.read())
            date = r["ResponseMetadata"]["HTTPHeaders"].get("date")
            return data, str(r["ETag"]), _age(date, r["LastModified"].timestamp())

        try:
            return s.run(s.aretry, f"read of {self.url()}", get)  # type: ignore[attr-defined, no-any-return]
        except UploadError as e:
            if cause_code(e) in ("404", "NoSuchKey"):
                return None
            raise

    def _put(self, data: bytes, **cond: str) -> str:
        r = self._call("write of", "put_object", Bucket=self.bucket, Key=self.key, Body=data, **cond)
        return str(r["ETag"])

    def create(self, data: bytes) -> str:
        return self._put(data, IfNoneMatch="*")

    def replace(self, data: bytes, version: str) -> str:
        try:
            return self._put(data, IfMatch=version)
        except UploadError as e:
            if cause_code(e) in ("404", "NoSuchKey"):
                raise Conflict(self.url()) from e
            raise

    def delete(self, version: str) -> None:
        # S3 deletes only unconditionally on most implementations (If-Match on DELETE is recent and not
        # everywhere): check the version, then delete. The window between is the owner's own.
        got = self.read(0)
        if got is not None and got[1] != version:
            raise Conflict(self.url())
        self.store.delete([self.path])


class GcsObject(CondObject):
    """Through gcsfs's own HTTP session (its credentials, endpoint and retries of transport errors)."""

    def __init__(self, store: ObjectStore, path: str) -> None:
        super().__init__(store, path)
        self.bucket, self.key, _ = store.fs.split_path(path)

    def read(self, limit: int) -> tuple[bytes, str, float] | None:
        fs = self.store.fs

        def get() -> tuple[bytes, str, float] | None:
            try:
                head = {"Range": f"bytes=0-{limit}"}
                headers, data = fs.call("GET", "b/{}/o/{}", self.bucket, self.key, alt="media", headers=head)
            except FileNotFoundError:
                return None
            except Exception as e:
                if getattr(e, "code", None) != 416:
                    raise
                return self._empty()  # an empty object has no byte 0 to range over
            gen = headers.get("x-goog-generation") or headers.get("X-Goog-Generation")
            if gen is None:  # an old emulator: ask for the object's metadata instead
                gen = str(fs.info(self.path)["generation"])
            modified = email.utils.parsedate_to_datetime(headers["Last-Modified"]).timestamp()
            return bytes(data)[: limit + 1], str(gen), _age(headers.get("Date"), modified)

        return self._retry("read of", get)

    def _empty(self) -> tuple[bytes, str, float] | None:
        """An empty object's version and age, from its metadata."""
        try:
            headers, raw = self.store.fs.call("GET", "b/{}/o/{}", self.bucket, self.key)
        except FileNotFoundError:
            return None
        meta = json.loads(raw)
        modified = datetime.datetime.fromisoformat(meta["updated"]).timestamp()
        return b"", str(meta["generation"]), _age(headers.get("Date"), modified)

    def _upload(self, data: bytes, generation: str) -> str:
        fs = self.store.fs
        meta = json.dumps({"name": self.key})
        body = (
            (
                f"--==0==\nContent-Type: application/json; charset=UTF-8\n\n{meta}\n--==0==\n"
                "Content-Type: application/json\n\n"
            ).encode()
            + data
            + b"\n--==0==--"
        )

        def put() -> str:
            try:
                j = fs.call(
                    "POST",
                    f"{fs._location}/upload/storage/v1/b/{quote(self.bucket)}/o",
                    uploadType="multipart",
                    headers={"Content-Type": 'multipart/related; boundary="==0=="'},
                    data=body,
                    json_out=True,
                    ifGenerationMatch=generation,
                )
            except (FileExistsError, FileNotFoundError) as e:  # gcsfs: 412 -> FileExistsError
                raise Conflict(self.url()) from e
            return str(j["generation"])

        return self._retry("write of", put)

    def create(self, data: bytes) -> str:
        return self._upload(data, "0")  # generation 0: "only if no live version exists"

    def replace(self, data: bytes, version: str) -> str:
        return self._upload(data, version)

    def delete(self, version: str) -> None:
        fs = self.store.fs

        def rm() -> None:
            try:
                fs.call("DELETE", "b/{}/o/{}", self.bucket, self.key, ifGenerationMatch=version)
            except FileNotFoundError:
                return
            except FileExistsError as e:
                raise Conflict(self.url()) from e

        self._retry("delete of", rm)


class AzureObject(CondObject):
    """Through adlfs's own (async) Azure SDK client: its credentials and endpoint."""

    def __init__(self, store: ObjectStore, path: str) -> None:
        super().__init__(store, path)
        container, _, self.blob = path.partition("/")
        self.client = store.fs.service_client.get_blob_client(container, self.blob)

    def _run(self, what: str, make: Callable[[], Any]) -> Any:
        from azure.core.exceptions import ResourceExistsError, ResourceModifiedError, ResourceNotFoundError
        from fsspec.asyn import sync

        async def once() -> Any:
            try:
                return await make()
            except (ResourceExistsError, ResourceModifiedError) as e:
                raise Conflict(self.url()) from e

        def call() -> Any:
            try:
                return sync(self.store.fs.loop, once)
            except ResourceNotFoundError:
                return None

        return self._retry(what, call)

    def read(self, limit: int) -> tuple[bytes, str, float] | None:
        date: list[str] = []

        async def get() -> tuple[bytes, str, float]:
            from azure.core.exceptions import HttpResponseError

            hook = lambda r: date.append(r.http_response.headers.get("Date", ""))  # noqa: E731
            try:
                dl = await self.client.download_blob(offset=0, length=limit + 1, raw_response_hook=hook)
            except HttpResponseError as e:
                # A ranged read of an empty blob is answered 416 InvalidRange (there is no byte 0): its
                # properties say so, and it is read as empty (judged then as any unreadable lease).
                if e.status_code != 416:
                    raise
                props = await self.client.get_blob_properties(raw_response_hook=hook)
                if props.size:
                    raise
                return (
                    b"",
                    str(props.etag),
                    _age(date[-1] if date else None, props.last_modified.timestamp()),
                )
            data = await dl.readall()
            props = dl.properties
            return (
                bytes(data),
                str(props.etag),
                _age(date[-1] if date else None, props.last_modified.timestamp()),
            )

        got: tuple[bytes, str, float] | None = self._run("read of", get)
        return got

    def create(self, data: bytes) -> str:
        r = self._run("write of", lambda: self.client.upload_blob(data, overwrite=False))
        if r is None:
            raise Conflict(self.url())
        return str(r["etag"])

    def replace(self, data: bytes, version: str) -> str:
        from azure.core import MatchConditions

        r = self._run(
            "write of",
            lambda: self.client.upload_blob(
                data, overwrite=True, etag=version, match_condition=MatchConditions.IfNotModified
            ),
        )
        if r is None:  # the blob is gone: "unchanged since read" cannot hold
            raise Conflict(self.url())
        return str(r["etag"])

    def delete(self, version: str) -> None:
        from azure.core import MatchConditions

        self._run(
            "delete of",
            lambda: self.client.delete_blob(etag=version, match_condition=MatchConditions.IfNotModified),
        )


def conditional_object(store: ObjectStore, path: str) -> CondObject | None:
    """The conditional-write object for ``path`` on ``store``; None where safepoint knows no way."""
    from safepoint.remote.s3store import S3Store

    if isinstance(store, S3Store):
        return S3Object(store, path)
    if store.protocol in ("gs", "gcs"):
        return GcsObject(store, path)
    if store.protocol in ("abfs", "az", "abfss"):
        return AzureObject(store, path)
    return None


def create_if_absent(store: ObjectStore, path: str, data: bytes) -> bool:
    """Write ``path`` only if no object is there: False if one with other contents is (another writer's).

    S3 through the store's own write (If-None-Match: *, with its CRC32C), GCS and Azure through their
    conditional objects; a store with no conditional create is written unconditionally. A create whose
    answer was lost is retried and refused: finding our own bytes there, it succeeded."""
    try:
        try:
            store.put_bytes(path, data, if_absent=True)
            return True
        except NotImplementedError:
            cond = conditional_object(store, path)
            if cond is None:
                store.put_bytes(path, data)
                return True
            cond.create(data)
            return True
    except (FileExistsError, Conflict):
        try:
            return store.get_bytes(path) == data
        except (UploadError, OSError):
            return False
