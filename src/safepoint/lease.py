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
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from safepoint.errors import LeaseError

LEASE_NAME = ".lease"
log = logging.getLogger("safepoint")


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
        return LeaseError(
            f"checkpoint root {root} is in use by pid {holder.get('pid')} on host {holder.get('host')!r} "
            f"(lease heartbeat {age:.0f}s ago). Two writers would corrupt each other's checkpoints: stop the "
            f"other job or use another root. If that job is dead on another host, the lease expires after "
            f"{self.stale_after_s:.0f}s; or delete {lease} by hand."
        )

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=self.thread_name, daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            lost = self._renew()
            if lost is not None:
                self.lost = lost
                log.error("safepoint: %s", lost)
                return

    @abc.abstractmethod
    def _renew(self) -> str | None:
        """Renew once. Returns why the lease is lost (taken by another process), or None; a transient
        failure is logged and retried at the next beat."""

    @abc.abstractmethod
    def _drop(self) -> None:
        """Remove the lease if it is still ours."""

    def check(self) -> None:
        if self.lost:
            raise LeaseError(self.lost)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self._drop()


class Lease(HeartbeatLease):
    """``ROOT/.lease`` on a local or network file system: O_EXCL create, rename-aside takeover."""

    def __init__(self, root: Path, *, stale_after_s: float = 120.0, heartbeat_s: float = 15.0) -> None:
        super().__init__(stale_after_s, heartbeat_s)
        self.path = root / LEASE_NAME

    def _record(self) -> dict[str, Any]:
        return {**self._owner(), "started": time.time(), "heartbeat": time.time(), "token": self.token}

    def acquire(self) -> None:
        for _ in range(20):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._read()
                age = time.time() - float(holder.get("heartbeat", 0)) if holder is not None else 0.0
                if holder is not None and not self._is_stale(holder, age):
                    raise self._in_use(str(self.path.parent), str(self.path), holder, age) from None
                # Stale (or unreadable): move it aside; only one contender's rename can succeed.
                aside = self.path.with_name(f"{LEASE_NAME}.stale-{self.token}")
                with contextlib.suppress(FileNotFoundError):
                    os.rename(self.path, aside)
                    os.unlink(aside)
                    if holder is not None:
                        log.warning(
                            "safepoint: took over stale lease of pid %s on %s",
                            holder.get("pid"),
                            holder.get("host"),
                        )
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self._record(), f)
                f.flush()
                os.fsync(f.fileno())
            self._start_heartbeat()
            return
        raise LeaseError(f"could not acquire {self.path}: it keeps changing hands")

    def _read(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else None
        except FileNotFoundError:
            return {"heartbeat": time.time()}  # vanished between open and read: treat as live, retry
        except (OSError, ValueError):
            return None

    def _renew(self) -> str | None:
        holder = self._read()
        if holder is None or holder.get("token") != self.token:
            return f"lease on {self.path.parent} was taken by another process ({holder})"
        tmp = self.path.with_name(f"{LEASE_NAME}.{self.token}.tmp")
        try:
            tmp.write_text(json.dumps(dict(holder, heartbeat=time.time())))
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("safepoint: lease heartbeat failed: %s", e)
        return None

    def _drop(self) -> None:
        holder = self._read()
        if holder is not None and holder.get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
