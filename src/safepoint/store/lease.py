"""Ownership of a checkpoint root: one live writer at a time.

``ROOT/.lease`` records host, pid, process start time and a heartbeat. A second live writer gets a clear
error naming the holder; a lease whose process is gone (same host) or whose heartbeat is stale (another
host) is taken over. Takeover renames the stale file aside first: rename succeeds for exactly one
contender, so two processes can never both take it.
"""

from __future__ import annotations

import abc
import contextlib
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from safepoint.errors import LeaseError

LEASE_NAME = ".lease"
UNREADABLE_WAIT_S = 2.0
"""How long ``acquire`` keeps re-reading a lease file it cannot read (NFS EIO/ESTALE, a creator between
its O_EXCL create and its write) before deciding by the file's age."""
log = logging.getLogger("safepoint")


class Unreadable(Exception):
    """The lease record could not be read or parsed: a transient condition, never proof of a new owner."""


def heartbeat_age(holder: dict[str, Any], now: float | None = None) -> float:
    """Seconds since ``holder``'s last heartbeat; infinite (stale) when the record has no usable one (null,
    a string, garbled): a heartbeat that cannot be read proves nothing about the holder being alive."""
    beat = holder.get("heartbeat")
    if isinstance(beat, bool) or not isinstance(beat, (int, float)) or not math.isfinite(beat):
        return math.inf
    return (time.time() if now is None else now) - float(beat)


def describe_holder(holder: dict[str, Any]) -> str:
    """'pid 12 on host 'a'' or, for a record that names neither, what it holds (never 'pid None')."""
    pid, host = holder.get("pid"), holder.get("host")
    if pid is None and host is None:
        return f"an owner whose lease record names no pid or host ({holder!r})"
    return f"pid {pid if pid is not None else '?'} on host {host!r}"


def _proc_start_ticks(pid: int) -> int | None:
    """Process start time from /proc (guards against pid reuse); None where /proc is absent."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _pid_alive(pid: int, start_ticks: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    current = _proc_start_ticks(pid)
    return start_ticks is None or current is None or current == start_ticks


class HeartbeatLease(abc.ABC):
    """What the file lease and the S3 lease share: a token naming this owner, the owner record, staleness,
    and a heartbeat thread that renews the lease until it is released or found taken by someone else.
    Subclasses say how to renew once (:meth:`_renew`) and how to give the lease back (:meth:`_drop`)."""

    thread_name = "safepoint-lease"

    def __init__(self, stale_after_s: float, heartbeat_s: float) -> None:
        self.stale_after_s = stale_after_s
        self.heartbeat_s = heartbeat_s
        self.token = uuid.uuid4().hex
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewed = time.monotonic()  # when the heartbeat last landed

    def _owner(self) -> dict[str, Any]:
        """Who holds the lease: host and pid, plus the process start time against pid reuse."""
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "start_ticks": _proc_start_ticks(os.getpid()),
        }

    def _is_stale(self, holder: dict[str, Any], age: float) -> bool:
        """A holder on this host is judged by its process (gone or not); elsewhere by ``age``, the time
        since its last heartbeat, against ``stale_after_s``."""
        if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
            if holder["pid"] == os.getpid() and holder.get("token") != self.token:
                return False  # another manager in this very process: alive by definition
            return not _pid_alive(holder["pid"], holder.get("start_ticks"))
        return age > self.stale_after_s

    def _in_use(self, root: str, lease: str, holder: dict[str, Any], age: float) -> LeaseError:
        beat = f"lease heartbeat {age:.0f}s ago" if math.isfinite(age) else "no readable lease heartbeat"
        return LeaseError(
            f"checkpoint root {root} is in use by {describe_holder(holder)} "
            f"({beat}). Two writers would corrupt each other's checkpoints: stop the "
            f"other job or use another root. If that job is dead on another host, the lease expires after "
            f"{self.stale_after_s:.0f}s; or delete {lease} by hand."
        )

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._renewed = time.monotonic()
        self._thread = threading.Thread(target=self._beat, name=self.thread_name, daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                lost = self._renew()
            except Unreadable as e:
                # Transient (NFS EIO/ESTALE, a throttled store): retried at the next beat. Only once no
                # heartbeat has landed for stale_after_s may another host have judged the lease stale and
                # taken it over: from then on it cannot be counted on.
                silent = time.monotonic() - self._renewed
                if silent <= self.stale_after_s:
                    log.warning("safepoint: lease heartbeat failed (will retry): %s", e)
                    continue
                lost = (
                    f"lease heartbeat failed for {silent:.0f}s, longer than lease_stale_after_s="
                    f"{self.stale_after_s:g}s (another job may have taken the root over meanwhile); last "
                    f"error: {e}"
                )
            if lost is not None:
                self.lost = lost
                log.error("safepoint: %s", lost)
                return
            self._renewed = time.monotonic()

    @abc.abstractmethod
    def _renew(self) -> str | None:
        """Renew once. Returns why the lease is lost (another owner holds it, or it was removed), or None
        once renewed; raises :class:`Unreadable` for a transient failure (retried at the next beat, until
        no heartbeat has landed for ``stale_after_s``)."""

    @abc.abstractmethod
    def _drop(self) -> None:
        """Remove the lease if it is still ours."""

    def check(self) -> None:
        if self.lost:
            raise LeaseError(self.lost)

    def stop(self) -> None:
        """End the heartbeat without waiting and without giving the lease back: it expires by itself."""
        self._stop.set()

    def release(self, timeout: float | None = None) -> bool:
        """Stop the heartbeat and give the lease back. ``timeout``: return after this long at most (the
        heartbeat thread and the removal together); what is not done by then goes on in a daemon thread,
        and if the process exits first the lease expires by itself (``stale_after_s``; on this host, as
        soon as the process is gone). Returns whether it was given back in time."""
        self._stop.set()
        thread, self._thread = self._thread, None

        def finish() -> None:
            if thread is not None:
                thread.join(timeout=5)
            self._drop()

        if timeout is None:
            finish()
            return True
        releaser = threading.Thread(target=finish, name=f"{self.thread_name}-release", daemon=True)
        releaser.start()
        releaser.join(max(0.0, timeout))
        return not releaser.is_alive()


class Lease(HeartbeatLease):
    """``ROOT/.lease`` on a local or network file system: created whole (fsynced, then hard-linked),
    taken over by renaming the stale file aside."""

    def __init__(self, root: Path, *, stale_after_s: float = 120.0, heartbeat_s: float = 15.0) -> None:
        super().__init__(stale_after_s, heartbeat_s)
        self.path = root / LEASE_NAME

    def _record(self) -> dict[str, Any]:
        return {**self._owner(), "started": time.time(), "heartbeat": time.time(), "token": self.token}

    def acquire(self) -> None:
        unreadable_since: float | None = None
        tries = 0
        while tries < 20:
            try:
                self._create()
            except FileExistsError:
                try:
                    holder = self._read()
                except Unreadable as e:
                    # Transient (EIO/ESTALE) or a creator between its create and its write: read again for
                    # a while; a file that stays unreadable is judged by its age.
                    unreadable_since = unreadable_since or time.monotonic()
                    age = self._file_age()
                    if age is None or age <= self.stale_after_s:
                        if time.monotonic() - unreadable_since < UNREADABLE_WAIT_S:
                            time.sleep(0.05)
                            continue
                        raise LeaseError(
                            f"cannot read the lease {self.path} ({e}), so its holder is unknown. If no job "
                            f"uses {self.path.parent}, delete it by hand; an unreadable lease is taken over "
                            f"once unchanged for lease_stale_after_s={self.stale_after_s:g}s."
                        ) from e
                    holder = {}
                if holder is None:
                    tries += 1
                    continue  # removed between the create and the read: try to create it again
                age = heartbeat_age(holder)
                if holder and not self._is_stale(holder, age):
                    raise self._in_use(str(self.path.parent), str(self.path), holder, age) from None
                # Stale (or unreadable for longer than stale_after_s): move it aside; only one contender's
                # rename can succeed.
                aside = self.path.with_name(f"{LEASE_NAME}.stale-{self.token}")
                with contextlib.suppress(FileNotFoundError):
                    os.rename(self.path, aside)
                    os.unlink(aside)
                    log.warning(
                        "safepoint: took over the stale lease of %s",
                        describe_holder(holder) if holder else "an unreadable lease file",
                    )
                tries += 1
                continue
            self._start_heartbeat()
            return
        raise LeaseError(f"could not acquire {self.path}: it keeps changing hands")

    def _create(self) -> None:
        """Create the lease file, complete or not at all (FileExistsError if there is one).

        The record is written and fsynced under a private name, then hard-linked into place: link is
        atomic and exclusive like O_EXCL, but a crash (or a power loss) can never leave a torn or empty
        ``.lease`` that would lock the next owner out until it goes stale. File systems without hard
        links fall back to O_EXCL + write."""
        tmp = self.path.with_name(f"{LEASE_NAME}.{self.token}.tmp")
        self._write_synced(tmp, self._record())
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            raise
        except OSError:  # no hard links here (EPERM/ENOTSUP/EOPNOTSUPP on some FUSE and object mounts)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as f:
                json.dump(self._record(), f)
                f.flush()
                os.fsync(f.fileno())
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    @staticmethod
    def _write_synced(path: Path, record: dict[str, Any]) -> None:
        with open(path, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())

    def _file_age(self) -> float | None:
        try:
            return time.time() - os.stat(self.path).st_mtime
        except OSError:
            return None

    def _read(self) -> dict[str, Any] | None:
        """The lease record; None if there is no lease file. Raises :class:`Unreadable` if it cannot be
        read or parsed (transient on NFS; a creator between its create and its write)."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise Unreadable(f"{self.path}: {e}") from e
        if not isinstance(data, dict):
            raise Unreadable(f"{self.path}: not a lease record: {data!r}")
        return data

    def _renew(self) -> str | None:
        holder = self._read()  # Unreadable: transient, retried by _beat
        if holder is None:
            return (
                f"lease {self.path} was removed (by hand, or by a job that judged it stale); this job no "
                "longer owns the root"
            )
        if holder.get("token") != self.token:
            return f"lease on {self.path.parent} was taken over by {describe_holder(holder)}"
        tmp = self.path.with_name(f"{LEASE_NAME}.{self.token}.tmp")
        try:
            # fsynced before the rename: a power loss must not turn the lease into an empty file.
            self._write_synced(tmp, dict(holder, heartbeat=time.time()))
            os.replace(tmp, self.path)
        except OSError as e:
            raise Unreadable(f"cannot write {self.path}: {e}") from e
        return None

    def _drop(self) -> None:
        try:
            holder = self._read()
        except Unreadable as e:
            log.warning("safepoint: not releasing %s: %s (it expires by itself)", self.path, e)
            return
        if holder is not None and holder.get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
