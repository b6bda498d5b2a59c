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

Under faults: a renewal refused by its condition is read back (a lost answer whose retry bounced off our
own write keeps the lease); a renewal that fails is retried at the next beat, and once the last one that
landed was sent half ``stale_after_s`` ago the fence renews the lease itself before a commit or delete, and
refuses when it cannot (heartbeat.HeartbeatLease.fence): the holder stops changing the root before anyone
may judge it stale. A renewal that lands late (held in the network past a takeover) carries the old
version and is refused. A record that cannot be read (garbage, wrong types at the top, over
MAX_LEASE_BYTES: only that much is fetched) is judged by its age on the store, as an unreadable lease file
is: never taken over while younger than ``stale_after_s`` (a live holder's lease overwritten by someone
must not hand the root to a second writer at once).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from safepoint.errors import LeaseError
from safepoint.remote.conditional import CondObject, Conflict, conditional_object
from safepoint.remote.retry import UploadError
from safepoint.store.heartbeat import MAX_LEASE_BYTES, HeartbeatLease, Unreadable, describe_holder
from safepoint.store.records import CorruptRecordError, parse_object

LEASE_NAME = ".lease"
log = logging.getLogger("safepoint")


class RemoteLease(HeartbeatLease):
    """``ROOT/.lease`` on an object store: conditional create, replace-if-unchanged takeover and heartbeat."""

    thread_name = "safepoint-remote-lease"
    renews_to_fence = True  # _renew is a conditional write: two threads renewing at once cannot clash

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
            raise Unreadable(f"{self._where()}: not a lease record ({self._why})")
        return holder

    def _record(self) -> bytes:
        return json.dumps({**self._owner(), "heartbeat": time.time(), "token": self.token}).encode()

    _why = "unreadable"  # why the last record read could not be (for messages)

    def _read(self) -> tuple[dict[str, Any] | None, str | None, float]:
        """(holder record or None if unreadable, its version or None if absent, its age by the store)."""
        got = self.obj.read(MAX_LEASE_BYTES)
        if got is None:
            return None, None, 0.0
        data, version, age = got
        if len(data) > MAX_LEASE_BYTES:
            self._why = f"larger than {MAX_LEASE_BYTES} bytes"
            return None, version, age
        try:
            rec = parse_object(data, self._where())
        except CorruptRecordError as e:
            self._why = str(e)
            return None, version, age  # unreadable: judged by its age (acquire), refused by the fence
        return rec, version, age

    def _unreadable(self, age: float) -> LeaseError:
        url = self._where()
        return LeaseError(
            f"checkpoint root {url.rsplit('/', 1)[0]} has a lease that cannot be read ({self._why}), "
            f"written {age:.0f}s ago by the store's clock: it may be a live job's lease overwritten, so it "
            f"is not taken over until it is older than {self.stale_after_s:.0f}s (lease_stale_after_s). If "
            f"no job uses this root, delete {url} by hand."
        )

    def acquire(self) -> None:
        for _ in range(20):
            sent = time.monotonic()  # the write below lands no earlier: the heartbeat counts from here
            try:
                self.version = self.obj.create(self._record())
            except Conflict:
                pass
            else:
                self._start_heartbeat(sent)
                return
            holder, version, age = self._read()
            if version is None:
                continue  # released in between: try to create again
            if holder is not None and holder.get("token") == self.token:
                self.version = version  # our create landed, but its answer was lost and the retry bounced
                self._start_heartbeat(sent)
                return
            if holder is None and age <= self.stale_after_s:  # (--force too: it takes readable leases)
                raise self._unreadable(age)
            if holder is not None and not self._is_stale(holder, age):
                url = self._where()
                raise self._in_use(url.rsplit("/", 1)[0], url, holder, age)
            sent = time.monotonic()
            try:
                self.version = self.obj.replace(self._record(), version)  # one contender replaces this one
            except Conflict:
                continue
            self._took_over(holder)
            self._start_heartbeat(sent)
            return
        raise LeaseError(f"could not acquire {self._where()}: it keeps changing hands")

    def _renew(self) -> str | None:
        assert self.version is not None
        for _ in range(2):
            try:
                self.version = self.obj.replace(self._record(), self.version)
                return None
            except Conflict:
                # Refused: someone else's version, or ours that landed unheard of (an answer lost and the
                # retry bouncing off it, or a renewal of an earlier beat delivered late). When ours was sent
                # is not known, and the heartbeat counts from when the write that landed was sent: write
                # again from the version read.
                try:
                    holder, version, _ = self._read()
                except (UploadError, OSError) as e:
                    raise Unreadable(str(e)) from e
                if version is None or holder is None or holder.get("token") != self.token:
                    return f"lease {self._where()} was {self._taken_by(holder, version)}"
                self.version = version
            except (UploadError, OSError) as e:
                raise Unreadable(str(e)) from e  # transient: retried at the next beat, up to stale_after_s
        raise Unreadable(f"{self._where()}: earlier renewals of ours kept landing late; not renewed now")

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
