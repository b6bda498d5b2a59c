"""Ownership of a checkpoint root: one live writer at a time.

``ROOT/.lease`` records host, pid, process start time and a heartbeat. A second live writer gets a clear
error naming the holder; a lease whose process is gone (same host) or whose heartbeat is stale (another
host) is taken over. Takeover renames the stale file aside first: rename succeeds for exactly one
contender, so two processes can never both take it.
"""

from __future__ import annotations

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


class Lease:
    def __init__(self, root: Path, *, stale_after_s: float = 120.0, heartbeat_s: float = 15.0) -> None:
        self.path = root / LEASE_NAME
        self.stale_after_s = stale_after_s
        self.heartbeat_s = heartbeat_s
        self.token = uuid.uuid4().hex
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> dict[str, Any]:
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "start_ticks": _proc_start_ticks(os.getpid()),
            "started": time.time(),
            "heartbeat": time.time(),
            "token": self.token,
        }

    def acquire(self) -> None:
        for _ in range(20):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._read()
                if holder is not None and not self._is_stale(holder):
                    age = time.time() - float(holder.get("heartbeat", 0))
                    raise LeaseError(
                        f"checkpoint root {self.path.parent} is in use by pid {holder.get('pid')} on host "
                        f"{holder.get('host')!r} (lease heartbeat {age:.0f}s ago). "
                        "Two writers would corrupt each other's checkpoints: stop the other job or use "
                        f"another root. If that job is dead on another host, the lease expires after "
                        f"{self.stale_after_s:.0f}s; or delete {self.path} by hand."
                    ) from None
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

    def _is_stale(self, holder: dict[str, Any]) -> bool:
        if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
            return not _pid_alive(holder["pid"], holder.get("start_ticks"))
        return time.time() - float(holder.get("heartbeat", 0)) > self.stale_after_s

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="safepoint-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            holder = self._read()
            if holder is None or holder.get("token") != self.token:
                self.lost = f"lease on {self.path.parent} was taken by another process ({holder})"
                log.error("safepoint: %s", self.lost)
                return
            tmp = self.path.with_name(f"{LEASE_NAME}.{self.token}.tmp")
            try:
                rec = dict(holder, heartbeat=time.time())
                tmp.write_text(json.dumps(rec))
                os.replace(tmp, self.path)
            except OSError as e:
                log.warning("safepoint: lease heartbeat failed: %s", e)

    def check(self) -> None:
        if self.lost:
            raise LeaseError(self.lost)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        holder = self._read()
        if holder is not None and holder.get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
