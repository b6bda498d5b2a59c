"""Ownership of a checkpoint root on an object store: one live writer at a time, by conditional writes.

Object stores have no O_EXCL, but S3, GCS and Azure all have conditional writes (remote/conditional.py):
create ``ROOT/.lease`` only if it does not exist, and replace it only if nobody changed it since we read it
(S3 and Azure: the ETag; GCS: the object's generation). So: acquire = create-if-absent; a stale lease (same
host and its pid is gone, or no heartbeat for ``stale_after_s``, measured on the store's clock) is taken
over by a replace-if-unchanged, which succeeds for exactly one contender; the heartbeat is a
replace-if-unchanged too, so a lease taken by someone else is noticed at the next beat, and every commit
and delete first reads the lease and checks the token (``fence``: a frozen owner never writes a manifest or
deletes after a takeover). A store safepoint knows no conditional writes for gets no lease: the manager
logs that the root is unprotected, and the local tier's lease still guards the local root.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from safepoint.errors import LeaseError
from safepoint.remote.conditional import CondObject, Conflict, conditional_object
from safepoint.remote.retry import UploadError
from safepoint.store.heartbeat import HeartbeatLease, Unreadable, describe_holder
from safepoint.store.records import CorruptRecordError, parse_object

LEASE_NAME = ".lease"
log = logging.getLogger("safepoint")


class RemoteLease(HeartbeatLease):
    """``ROOT/.lease`` on an object store: conditional create, replace-if-unchanged takeover and heartbeat."""

    thread_name = "safepoint-remote-lease"

    def __init__(
        self,
        obj: CondObject,
        *,
        stale_after_s: float = 120.0,
        heartbeat_s: float | None = None,
        job: str | None = None,
    ) -> None:
        super().__init__(stale_after_s, heartbeat_s, job)
        self.obj = obj
        self.version: str | None = None

    @classmethod
    def for_layout(cls, layout: Any, stale_after_s: float, job: str | None = None) -> RemoteLease | None:
        obj = conditional_object(layout.store, layout._p(LEASE_NAME))
        if obj is not None:
            return cls(obj, stale_after_s=stale_after_s, job=job)
        log.warning(
            "safepoint: %s has no conditional writes that safepoint knows; nothing stops a second job from "
            "writing to it at the same time",
            layout.root,
        )
        return None

    def _where(self) -> str:
        return self.obj.url()

    def _holder(self) -> dict[str, Any] | None:
        try:
            holder, version, _ = self._read()
        except (UploadError, OSError) as e:
            raise Unreadable(str(e)) from e
        if version is None:
            return None
        if holder is None:
            raise Unreadable(f"{self._where()}: not a lease record")
        return holder

    def _record(self) -> bytes:
        return json.dumps({**self._owner(), "heartbeat": time.time(), "token": self.token}).encode()

    def _read(self) -> tuple[dict[str, Any] | None, str | None, float]:
        """(holder record or None if unreadable, its version or None if absent, its age by the store)."""
        got = self.obj.read()
        if got is None:
            return None, None, 0.0
        data, version, age = got
        try:
            rec = parse_object(data, self._where())
        except CorruptRecordError:
            return None, version, age  # unreadable: judged like one (see _holder and acquire)
        return rec, version, age

    def acquire(self) -> None:
        for _ in range(20):
            try:
                self.version = self.obj.create(self._record())
            except Conflict:
                pass
            else:
                self._start_heartbeat()
                return
            holder, version, age = self._read()
            if version is None:
                continue  # released in between: try to create again
            if holder is not None and holder.get("token") == self.token:
                self.version = version  # our create landed, but its answer was lost and the retry bounced
                self._start_heartbeat()
                return
            if holder is not None and not self._is_stale(holder, age):
                url = self._where()
                raise self._in_use(url.rsplit("/", 1)[0], url, holder, age)
            try:
                self.version = self.obj.replace(self._record(), version)  # one contender replaces this one
            except Conflict:
                continue
            self._took_over(holder)
            self._start_heartbeat()
            return
        raise LeaseError(f"could not acquire {self._where()}: it keeps changing hands")

    def _renew(self) -> str | None:
        try:
            assert self.version is not None
            self.version = self.obj.replace(self._record(), self.version)
        except Conflict:
            # Refused: someone else's version, or ours whose answer was lost and the retry bounced off it.
            try:
                holder, version, _ = self._read()
            except (UploadError, OSError) as e:
                raise Unreadable(str(e)) from e
            if holder is not None and holder.get("token") == self.token:
                self.version = version
                return None
            return f"lease {self._where()} was {self._taken_by(holder, version)}"
        except (UploadError, OSError) as e:
            raise Unreadable(str(e)) from e  # transient: retried at the next beat, up to stale_after_s
        return None

    @staticmethod
    def _taken_by(holder: dict[str, Any] | None, version: str | None) -> str:
        if version is None:
            return "removed (by hand, or by a job that judged it stale)"
        return f"taken over by {describe_holder(holder) if holder else 'another process'}"

    def _drop(self) -> None:
        try:
            holder, version, _ = self._read()
            if version is not None and holder is not None and holder.get("token") == self.token:
                self.obj.delete(version)
        except (Conflict, UploadError, OSError) as e:
            log.warning("safepoint: could not release %s: %s", self._where(), e)
