"""The lease every store shares: timing rules, who holds it, the heartbeat thread, fencing, release.

``lease.Lease`` (a file on a local or network file system) and ``remote.object_lease.RemoteLease`` (an object,
by conditional writes) differ only in how a record is created, read, renewed and dropped; everything
here is the same for both. Fencing: the owner's token is checked against the lease on the store
(:meth:`HeartbeatLease.fence`) right before every commit and every delete, so an owner that was frozen
(SIGSTOP, a VM pause, a long GC) while another job took the root over can never commit or delete.
"""

from __future__ import annotations

import abc
import functools
import logging
import math
import os
import socket
import threading
import time
import uuid
from typing import Any

from safepoint.errors import LeaseError, LeaseUnconfirmed
from safepoint.store.guard import read_regular

DEFAULT_STALE_AFTER_S = 120.0
HEARTBEAT_S = 15.0
"""The heartbeat interval for the default ``lease_stale_after_s`` (120 s): a quarter of it at most."""
MIN_STALE_AFTER_S = 1.0
"""The smallest ``lease_stale_after_s`` a manager accepts: below it the heartbeat would spin."""
MAX_LEASE_BYTES = 64 << 10
"""A lease record is a few hundred bytes: a larger one is not read past this (unreadable)."""
UNREADABLE_WAIT_S = 2.0
"""How long ``acquire`` keeps re-reading a lease file it cannot read (NFS EIO/ESTALE, a creator between
its O_EXCL create and its write) before deciding by the file's age."""
log = logging.getLogger("safepoint")


class HeldByThisJob(LeaseError):
    """The root is held by a live process of this same job on this host (an evaluation in the same
    allocation, say): never taken over; the manager restores without the lease and refuses saves."""


# Tokens of leases this process gave back (``release``): a record still carrying one outlived its release
# (a failed delete), so the next manager here takes it over rather than refuse a root "in use" by itself.
_GIVEN_UP: set[str] = set()


class Unreadable(Exception):
    """The lease record could not be read or parsed: a transient condition, never proof of a new owner."""


def heartbeat_for(stale_after_s: float) -> float:
    """The heartbeat interval for ``stale_after_s``: HEARTBEAT_S, or a quarter of a shorter staleness
    limit, so a live holder always beats several times before anyone may judge it stale."""
    return min(HEARTBEAT_S, stale_after_s / 4)


def check_lease_timing(stale_after_s: float, heartbeat_s: float) -> None:
    """ValueError unless both are finite numbers and the staleness limit exceeds twice the heartbeat:
    with less, one late beat (a busy NFS server, a GC pause) lets a second job take over a live holder."""
    for name, value in (("lease_stale_after_s", stale_after_s), ("lease heartbeat", heartbeat_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
    if heartbeat_s <= 0 or stale_after_s <= 2 * heartbeat_s:
        raise ValueError(
            f"lease_stale_after_s must exceed twice the heartbeat interval ({heartbeat_s:g}s), got "
            f"{stale_after_s!r}: otherwise a second job could take over a live holder"
        )


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


def _proc_stat(pid: int) -> tuple[bytes, int] | None:
    """Process state and start time (guards against pid reuse) from /proc; None where /proc is absent."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _proc_start_ticks(pid: int) -> int | None:
    stat = _proc_stat(pid)
    return None if stat is None else stat[1]


# A killed process whose parent has not reaped it yet (a zombie; ``X``: being reaped) keeps its pid, and
# ``kill(pid, 0)`` still succeeds, but it can never write again. Its parent may be dead too and init slow to
# reap (seconds in containers): a restart right after a kill -9 must take over, not fail with a LeaseError.
# (A process whose main thread exited while others run also shows "Z"; a Python holder's main thread never
# exits before the interpreter, which joins its threads first.)
_DEAD_STATES = (b"Z", b"X")


def _pid_alive(pid: int, start_ticks: int | None) -> bool:
    """Whether ``pid`` (a process of this PID namespace: see :func:`askable_pid`) still runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = _proc_stat(pid)
    if stat is None:
        return True
    state, current = stat
    return state not in _DEAD_STATES and (start_ticks is None or current == start_ticks)


PID_MAX = 1 << 22
"""Linux's largest pid (PID_MAX_LIMIT): a lease pid outside [1, PID_MAX] is no process (``kill(-1, 0)``
reaches every process and would call the holder alive forever; ``10**30`` overflows ``kill``)."""


def _read_ident(path: str) -> str | None:
    try:
        return read_regular(path, 256).decode().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


@functools.cache
def namespace_identity() -> tuple[str | None, int | None]:
    """(boot id, PID namespace inode) of this process; None where /proc cannot say (not Linux).

    Two processes can ask each other's pids with ``kill(pid, 0)`` only when both are equal: the same host
    name proves nothing (containers with host networking, SageMaker's ``algo-1`` on every instance, a
    sidecar in its own PID namespace), and a pid of another namespace names another process here, or none.
    """
    try:
        pid_ns: int | None = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pid_ns = None
    return _read_ident("/proc/sys/kernel/random/boot_id"), pid_ns


def askable_pid(holder: dict[str, Any]) -> int | None:
    """The pid of ``holder`` if this process can ask whether it lives: same host name, same boot, same PID
    namespace (:func:`namespace_identity`), and a pid that can be a process. None otherwise: then only the
    heartbeat's age says whether the holder lives (a record without the identity, written by an older
    safepoint or by hand, is judged that way too)."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or type(pid) is not int or not 1 <= pid <= PID_MAX:
        return None
    boot, pid_ns = namespace_identity()
    if holder.get("boot_id") != boot or holder.get("pid_ns") != pid_ns:
        return None
    return pid


class HeartbeatLease(abc.ABC):
    """What the file lease and the S3 lease share: a token naming this owner, the owner record, staleness,
    and a heartbeat thread that renews the lease until it is released or found taken by someone else.
    Subclasses say how to renew once (:meth:`_renew`) and how to give the lease back (:meth:`_drop`)."""

    thread_name = "safepoint-lease"

    def __init__(self, stale_after_s: float, heartbeat_s: float | None, job: str | None = None) -> None:
        if heartbeat_s is None:
            heartbeat_s = heartbeat_for(stale_after_s) if math.isfinite(stale_after_s) else HEARTBEAT_S
        check_lease_timing(stale_after_s, heartbeat_s)
        self.stale_after_s = stale_after_s
        self.heartbeat_s = heartbeat_s
        self.token = uuid.uuid4().hex
        self.job = job  # store/job.py: a holder of the same job is taken over at once, on any host
        # `safepoint prune --force`: any readable holder counts as stale. Taking it over is what fences it
        # (its token is gone from the store: its next commit or delete refuses); an unreadable lease or one
        # that is no lease file is still refused.
        self.forced = False
        self.lost: str | None = None
        self.beats = 0  # heartbeat attempts so far (lets tests wait for beats instead of sleeping)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # When the write that last renewed the lease was *sent* (monotonic): the store applied it no
        # earlier, so nobody may judge the lease stale before _renewed + stale_after_s (see fence).
        self._renewed = time.monotonic()
        # One renewal at a time (heartbeat's or fence's): a write of ours landed unheard of is this one's.
        self._renewing = threading.Lock()

    def _owner(self) -> dict[str, Any]:
        """Who holds the lease: host and pid, plus the process start time against pid reuse, and the job
        (None: no job identity, see store/job.py)."""
        boot, pid_ns = namespace_identity()
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "start_ticks": _proc_start_ticks(os.getpid()),
            "boot_id": boot,
            "pid_ns": pid_ns,
            "job": self.job,
        }

    def _same_process(self, holder: dict[str, Any]) -> bool:
        return askable_pid(holder) == os.getpid()

    def _same_job(self, holder: dict[str, Any]) -> bool:
        """A holder of this very job, other than this process (which is alive by definition)."""
        return self.job is not None and holder.get("job") == self.job and not self._same_process(holder)

    def _is_stale(self, holder: dict[str, Any], age: float) -> bool:
        """Whether ``holder`` may be taken over: when its process can be asked (same host, boot and PID
        namespace: :func:`askable_pid`) exactly when it is gone, same job or not (a live process with the
        same job id is another part of this job: an evaluation in the same allocation must not take the
        trainer's root); otherwise (another host, another container or PID namespace with the same host
        name) a previous attempt of this job at once (a restart: its process cannot be asked, and a job id
        names one run of one job, see store/job.py), any other holder when ``age``, the time since its
        last heartbeat, exceeds ``stale_after_s``. Never ``kill(pid, 0)`` across namespaces: there the pid
        names another process, or none, and a live holder would be taken over at once."""
        if self.forced:
            return True
        pid = askable_pid(holder)
        if pid is not None:
            if pid == os.getpid() and holder.get("token") != self.token:
                # Another manager in this very process: alive by definition, unless it gave the lease back
                # and only its record is left (_GIVEN_UP).
                return holder.get("token") in _GIVEN_UP
            ticks = holder.get("start_ticks")
            return not _pid_alive(pid, ticks if type(ticks) is int else None)
        if self._same_job(holder):
            return True
        return age > self.stale_after_s

    def _took_over(self, holder: dict[str, Any] | None) -> None:
        who = describe_holder(holder) if holder else "an unreadable lease file"
        if holder and self.forced:
            log.warning(
                "safepoint: took over the lease of %s by force: that job can no longer commit or delete "
                "(its next save fails with LeaseError)", who,
            )  # fmt: skip
        elif holder and self._same_job(holder):
            log.warning(
                "safepoint: took over the lease of %s: a previous attempt of this job (%s)", who, self.job
            )
        else:
            log.warning("safepoint: took over the stale lease of %s", who)

    def _in_use(self, root: str, lease: str, holder: dict[str, Any], age: float) -> LeaseError:
        beat = f"lease heartbeat {age:.0f}s ago" if math.isfinite(age) else "no readable lease heartbeat"
        theirs = holder.get("job")
        jobs = f"job {theirs!r}" if isinstance(theirs, str) else "no job id"
        ours = f"this job is {self.job!r}" if self.job else "this job has no job id"
        if self._same_job(holder):
            return HeldByThisJob(
                f"checkpoint root {root} is held by {describe_holder(holder)}, a live process of this same "
                f"job ({self.job!r})"
            )
        return LeaseError(
            f"checkpoint root {root} is in use by {describe_holder(holder)} "
            f"({jobs}; {beat}). Two writers would corrupt each other's checkpoints: stop the "
            f"other job or use another root. If that job is dead on another host, the lease expires after "
            f"{self.stale_after_s:.0f}s, a restart of the same job takes it over at once ({ours}; see "
            f"ClusterOptions.job_id), or delete {lease} by hand."
        )

    def _start_heartbeat(self, sent: float | None = None) -> None:
        """``sent``: when the write that acquired the lease was sent (default: now)."""
        self._stop.clear()
        self._renewed = time.monotonic() if sent is None else sent
        self._thread = threading.Thread(target=self._beat, name=self.thread_name, daemon=True)
        self._thread.start()

    def _landed(self, sent: float) -> None:
        self._renewed = max(self._renewed, sent)  # (the fence may renew too, from another thread)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                with self._renewing:
                    sent = time.monotonic()
                    lost = self._renew()
                self.beats += 1
            except Unreadable as e:
                self.beats += 1
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
            self._landed(sent)

    @abc.abstractmethod
    def _renew(self) -> str | None:
        """Renew once. Returns why the lease is lost (another owner holds it, or it was removed), or None
        once renewed; raises :class:`Unreadable` for a transient failure (retried at the next beat, until
        no heartbeat has landed for ``stale_after_s``)."""

    @abc.abstractmethod
    def _drop(self) -> None:
        """Remove the lease if it is still ours."""

    @abc.abstractmethod
    def _holder(self) -> dict[str, Any] | None:
        """The lease record on the store now (None: there is none); raises :class:`Unreadable`."""

    @abc.abstractmethod
    def _where(self) -> str:
        """The lease's path or URL, for messages."""

    def check(self) -> None:
        if self.lost:
            raise LeaseError(self.lost)

    renews_to_fence = False
    """Whether :meth:`fence` renews the lease itself once the last renewal is half ``stale_after_s`` old
    (the object lease: its renewal is a conditional write, so it can never replace another owner's)."""

    def fence(self, action: str) -> None:
        """Raise LeaseError unless the lease on the store still carries this owner's token. Called right
        before each commit rename and each delete (``action`` says which, for the message): the heartbeat
        notices a takeover only at its next beat, and a process frozen after its last check must find
        out before it changes anything. An unreadable lease refuses too: ownership cannot be confirmed.

        Reading our own token proves only that nobody took the root over *yet*. Once the last renewal was
        sent over half ``stale_after_s`` ago (failing heartbeats, a stalled store, a paused process), another
        job may judge the lease stale the next moment, and the change about to be made would land after
        its takeover: with ``renews_to_fence`` the fence then renews the lease itself (a conditional write:
        it lands only if nobody took the lease, and then nobody may for another ``stale_after_s``) and
        refuses if that fails: the holder stops changing the root before anyone may take it over."""
        if self.lost:
            raise LeaseError(f"not {action}: {self.lost}")
        if not (self.renews_to_fence and time.monotonic() - self._renewed > self.stale_after_s / 2):
            self._confirm(action)
            return
        # A renewal in flight (the heartbeat's, on a slow store) is waited for, a beat's time at most.
        if not self._renewing.acquire(timeout=self.heartbeat_s):
            self._confirm(action)  # taken over meanwhile: that is the news
            raise LeaseError(
                f"not {action}: a renewal of the lease has been in flight for over {self.heartbeat_s:g}s "
                f"and none landed for {self.stale_after_s / 2:g}s: ownership cannot be confirmed"
            )
        try:
            silent = time.monotonic() - self._renewed
            if silent <= self.stale_after_s / 2:  # the heartbeat landed while we waited
                self._confirm(action)
                return
            sent = time.monotonic()
            try:
                lost = self._renew()
            except Unreadable as e:
                self._confirm(action)  # taken over or removed meanwhile: that is the news, naming who
                raise LeaseError(
                    f"not {action}: the lease was last renewed {silent:.1f}s ago and renewing it now failed, "
                    f"so another job may take the root over once {self.stale_after_s:g}s "
                    f"(lease_stale_after_s) have passed; ownership cannot be confirmed ({e})"
                ) from e
        finally:
            self._renewing.release()
        if lost is not None:
            self.lost = self.lost or f"{lost}; this job no longer owns the root"
            raise LeaseError(f"not {action}: {lost}; this job no longer owns the root")
        self._landed(sent)

    def _confirm(self, action: str) -> None:
        """LeaseError unless the lease on the store carries this owner's token (read, not written)."""
        try:
            holder = self._holder()
        except Unreadable as e:
            raise LeaseUnconfirmed(f"not {action}: cannot confirm this job still owns the root ({e})") from e
        if holder is None:
            why = f"lease {self._where()} was removed (by hand, or the root was deleted)"
        elif holder.get("token") != self.token:
            why = f"lease {self._where()} was taken over by {describe_holder(holder)}"
        else:
            return
        self.lost = self.lost or f"{why}; this job no longer owns the root"
        raise LeaseError(f"not {action}: {why}; this job no longer owns the root")

    def stop(self) -> None:
        """End the heartbeat without waiting and without giving the lease back: it expires by itself."""
        self._stop.set()

    def release(self, timeout: float | None = None) -> bool:
        """Stop the heartbeat and give the lease back. ``timeout``: return after this long at most (the
        heartbeat thread and the removal together); what is not done by then goes on in a daemon thread,
        and if the process exits first the lease expires by itself (``stale_after_s``; on this host, as
        soon as the process is gone). Returns whether it was given back in time."""
        self._stop.set()
        _GIVEN_UP.add(self.token)
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
