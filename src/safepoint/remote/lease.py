"""Ownership of a checkpoint root on S3: one live writer at a time, by conditional writes.

S3 has no O_EXCL, but it has conditional writes: ``If-None-Match: *`` creates ``ROOT/.lease`` only if it
does not exist, and ``If-Match: <etag>`` replaces it only if nobody changed it since we read it. So:
acquire = create-if-absent; a stale lease (same host and its pid is gone, or no heartbeat for
``stale_after_s``, measured on the store's clock) is taken over by a replace-if-unchanged, which succeeds
for exactly one contender; the heartbeat is a replace-if-unchanged too, so a lease taken by someone else is
noticed at the next beat, and every commit and delete first reads the lease and checks the token
(``fence``: a frozen owner never writes a manifest or deletes after a takeover). Stores without
conditional writes (gs://, az:// through fsspec here) get no lease: the manager logs that the root is
unprotected, and the local tier's lease still guards the local root.
"""

from __future__ import annotations

import email.utils
import json
import logging
import time
from typing import Any

from safepoint.errors import LeaseError
from safepoint.remote.retry import UploadError, cause_code
from safepoint.store.heartbeat import HeartbeatLease, Unreadable, describe_holder

LEASE_NAME = ".lease"
log = logging.getLogger("safepoint")
_CONFLICT = ("PreconditionFailed", "ConditionalRequestConflict")


class RemoteLease(HeartbeatLease):
    """``ROOT/.lease`` on S3: conditional create, replace-if-unchanged takeover and heartbeat."""

    thread_name = "safepoint-remote-lease"

    def __init__(
        self,
        store: Any,
        key: str,
        *,
        stale_after_s: float = 120.0,
        heartbeat_s: float | None = None,
        job: str | None = None,
    ) -> None:
        super().__init__(stale_after_s, heartbeat_s, job)
        self.store, self.key = store, key
        self.bucket, self.obj = store._split(key)
        self.etag: str | None = None

    @classmethod
    def for_layout(cls, layout: Any, stale_after_s: float, job: str | None = None) -> RemoteLease | None:
        from safepoint.remote.s3store import S3Store

        if isinstance(layout.store, S3Store):
            return cls(layout.store, layout._p(LEASE_NAME), stale_after_s=stale_after_s, job=job)
        log.warning(
            "safepoint: %s has no conditional writes through fsspec; nothing stops a second job from "
            "writing to it at the same time",
            layout.root,
        )
        return None

    def _where(self) -> str:
        return str(self.store.url(self.key))

    def _holder(self) -> dict[str, Any] | None:
        try:
            holder, etag, _ = self._read()
        except (UploadError, OSError) as e:
            raise Unreadable(str(e)) from e
        if etag is None:
            return None
        if holder is None:
            raise Unreadable(f"{self._where()}: not a lease record")
        return holder

    def _record(self) -> bytes:
        return json.dumps({**self._owner(), "heartbeat": time.time(), "token": self.token}).encode()

    def _put(self, **cond: str) -> str:
        s = self.store
        r = s.run(
            s.aretry,
            f"lease {s.url(self.key)}",
            lambda: s.call("put_object", Bucket=self.bucket, Key=self.obj, Body=self._record(), **cond),
        )
        return str(r["ETag"])

    def _read(self) -> tuple[dict[str, Any] | None, str | None, float]:
        """(holder record or None if unreadable, its etag or None if absent, its age on the store clock)."""
        s = self.store

        async def get() -> tuple[bytes, str, float]:
            r = await s.call("get_object", Bucket=self.bucket, Key=self.obj)
            async with r["Body"] as body:
                data = bytes(await body.read())
            date = r["ResponseMetadata"]["HTTPHeaders"].get("date")
            now = email.utils.parsedate_to_datetime(date).timestamp() if date else time.time()
            return data, str(r["ETag"]), now - r["LastModified"].timestamp()

        try:
            data, etag, age = s.run(s.aretry, f"lease {s.url(self.key)}", get)
        except UploadError as e:
            if cause_code(e) in ("404", "NoSuchKey"):
                return None, None, 0.0
            raise
        try:
            rec = json.loads(data)
        except ValueError:
            return None, etag, age
        return (rec if isinstance(rec, dict) else None), etag, age

    def acquire(self) -> None:
        for _ in range(20):
            try:
                self.etag = self._put(IfNoneMatch="*")
            except UploadError as e:
                if cause_code(e) not in _CONFLICT:
                    raise
            else:
                self._start_heartbeat()
                return
            holder, etag, age = self._read()
            if etag is None:
                continue  # released in between: try to create again
            if holder is not None and holder.get("token") == self.token:
                self.etag = etag  # our create landed, but its answer was lost and the retry bounced off it
                self._start_heartbeat()
                return
            if holder is not None and not self._is_stale(holder, age):
                url = self.store.url(self.key)
                raise self._in_use(url.rsplit("/", 1)[0], url, holder, age)
            try:
                self.etag = self._put(IfMatch=etag)  # only one contender replaces this exact version
            except UploadError as e:
                if cause_code(e) not in _CONFLICT:
                    raise
                continue
            self._took_over(holder)
            self._start_heartbeat()
            return
        raise LeaseError(f"could not acquire {self.store.url(self.key)}: it keeps changing hands")

    def _renew(self) -> str | None:
        try:
            assert self.etag is not None
            self.etag = self._put(IfMatch=self.etag)
        except UploadError as e:
            if cause_code(e) in _CONFLICT or cause_code(e) in ("404", "NoSuchKey"):
                return f"lease {self.store.url(self.key)} was {self._taken_by()}"
            raise Unreadable(str(e)) from e  # transient: retried at the next beat, up to stale_after_s
        return None

    def _taken_by(self) -> str:
        """Who holds the lease now, for the message (best effort: one read, no error of its own)."""
        try:
            holder, etag, _ = self._read()
        except (UploadError, OSError):
            return "taken over by another process"
        if etag is None:
            return "removed (by hand, or by a job that judged it stale)"
        return f"taken over by {describe_holder(holder) if holder else 'another process'}"

    def _drop(self) -> None:
        try:
            holder, _, _ = self._read()
            if holder is not None and holder.get("token") == self.token:
                self.store.delete([self.key])
        except (UploadError, OSError) as e:
            log.warning("safepoint: could not release %s: %s", self.store.url(self.key), e)
