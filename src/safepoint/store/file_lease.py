"""Ownership of a checkpoint root: one live writer at a time.

``ROOT/.lease`` records host, pid, process start time and a heartbeat. A second live writer gets a clear
error naming the holder; a lease whose process is gone (same host) or whose heartbeat is stale (another
host) is taken over. Takeover renames the stale file aside first: rename succeeds for exactly one
contender, so two processes can never both take it.

Fencing: the owner's token is checked against the lease on the store (:meth:`HeartbeatLease.fence`) right
before every commit rename and every delete, so an owner that was frozen (SIGSTOP, a VM pause, a long GC)
while another job took the root over can never commit or delete afterwards: its token is no longer there.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from safepoint.errors import LeaseError
from safepoint.store.guard import NotRegularFileError
from safepoint.store.heartbeat import (
    DEFAULT_STALE_AFTER_S,
    MAX_LEASE_BYTES,
    UNREADABLE_WAIT_S,
    HeartbeatLease,
    Unreadable,
    describe_holder,
    heartbeat_age,
)
from safepoint.store.records import CorruptRecordError, parse_object
from safepoint.store.rootfs import RootDir

log = logging.getLogger("safepoint")
LEASE_NAME = ".lease"


class NotALeaseFile(Unreadable):
    """``.lease`` is a symlink, FIFO, directory or device: never written by safepoint, so never judged
    stale or taken over (that would follow it, or delete what it is); refused with a clear error."""


class Lease(HeartbeatLease):
    """``ROOT/.lease`` on a local or network file system: created whole (fsynced, then hard-linked),
    taken over by renaming the stale file aside, renewed by touching the very file this owner created.

    Why the heartbeat is the file's mtime, set through a descriptor, rather than a rewritten record: a
    renewal must be a compare-and-swap. "Read the record, check the token, replace the file" is not one: a
    takeover between the read and the replace is overwritten, and the legitimate new owner then loses. A
    file system offers no replace-if-unchanged by name, but an open descriptor stays bound to the inode it
    was opened on. So renew opens ``.lease``, checks the token *in that inode*, and touches that inode
    (futimens). A taker renames the old inode aside and links a new one in its place; a renewal racing with
    it touches the old, orphaned inode, never the new owner's, and the next beat finds the new token. The
    record itself is never rewritten, so readers never see it torn. Staleness is the file's mtime age."""

    _last_parsed: tuple[bytes, dict[str, Any]] | None = None
    """The last lease file's bytes that parsed, and the record (see ``_parse``); any lease of the process."""

    def __init__(
        self,
        root: Path,
        *,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        heartbeat_s: float | None = None,
        job: str | None = None,
    ) -> None:
        super().__init__(stale_after_s, heartbeat_s, job)
        self.path = root / LEASE_NAME
        # Every file of the lease through the guarded walk (store/rootfs.py): ROOT opened as given, each
        # name in it with O_NOFOLLOW, regular files only, renames and links between descriptors.
        self._fs = RootDir(root)

    def _where(self) -> str:
        return str(self.path)

    def _record(self) -> dict[str, Any]:
        # "heartbeat" is when the lease was created; the live heartbeat is the file's mtime (see above).
        return {**self._owner(), "started": time.time(), "heartbeat": time.time(), "token": self.token}

    def _age(self, holder: dict[str, Any], mtime: float) -> float:
        """Seconds since the holder's last beat (the file's mtime); infinite for a record without a usable
        ``heartbeat`` field (not written by a safepoint owner: proves nothing about a live holder)."""
        if not math.isfinite(heartbeat_age(holder)):
            return math.inf
        return time.time() - mtime

    def acquire(self) -> None:
        unreadable_since: float | None = None
        tries = 0
        while tries < 20:
            try:
                self._create()
            except FileExistsError:
                try:
                    found = self._read()
                except NotALeaseFile as e:
                    raise LeaseError(
                        f"{e}: not a lease safepoint wrote, so it is neither read nor taken over; if no job "
                        f"uses {self.path.parent}, remove it by hand"
                    ) from None
                except Unreadable as e:
                    # Transient (EIO/ESTALE) or a creator between its create and its write: read again for
                    # a while; a file that stays unreadable is judged by its age.
                    unreadable_since = unreadable_since or time.monotonic()
                    st = self._lstat()
                    age = None if st is None else time.time() - st.st_mtime
                    if st is None or age is None or age <= self.stale_after_s:
                        if time.monotonic() - unreadable_since < UNREADABLE_WAIT_S:
                            time.sleep(0.05)
                            continue
                        raise LeaseError(
                            f"cannot read the lease {self.path} ({e}), so its holder is unknown. If no job "
                            f"uses {self.path.parent}, delete it by hand; an unreadable lease is taken over "
                            f"once unchanged for lease_stale_after_s={self.stale_after_s:g}s."
                        ) from e
                    found = ({}, st)
                if found is None:
                    tries += 1
                    continue  # removed between the create and the read: try to create it again
                holder, judged = found
                age = self._age(holder, judged.st_mtime) if holder else math.inf
                if holder and not self._is_stale(holder, age):
                    raise self._in_use(str(self.path.parent), str(self.path), holder, age) from None
                # Stale (or unreadable for longer than stale_after_s): move it aside; only one contender's
                # rename can succeed.
                self._take_aside(holder, judged)
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
        tmp = f"{LEASE_NAME}.{self.token}.tmp"
        record = json.dumps(self._record())
        self._fs.write(tmp, record.encode())  # fsync'd; a link planted at the name is unlinked, not followed
        try:
            self._fs.link(tmp, LEASE_NAME)
        except FileExistsError:
            raise
        except OSError:  # no hard links here (EPERM/ENOTSUP/EOPNOTSUPP on some FUSE and object mounts)
            with os.fdopen(self._fs.create(LEASE_NAME, exclusive=True), "w") as f:
                f.write(record)
                f.flush()
                os.fsync(f.fileno())
        finally:
            with contextlib.suppress(OSError):
                self._fs.remove(tmp)

    def _take_aside(self, holder: dict[str, Any], judged: os.stat_result) -> None:
        """Move the lease judged stale out of the way, and only that one. Rename moves whatever is at
        ``.lease`` now: another contender may have taken the same stale lease over since this one read it
        and linked its fresh lease in. So the moved file must be the very inode judged stale; any other
        is put back (link: over nothing) and this contender loses at its next look."""
        aside = f"{LEASE_NAME}.stale-{self.token}"
        try:
            self._fs.move(LEASE_NAME, aside)
        except FileNotFoundError:
            return
        if self._is_file(aside, judged, holder.get("token")):
            self._fs.remove(aside)
            self._took_over(holder)
            return
        with contextlib.suppress(OSError):  # someone else's lease: back in place, over nothing
            self._fs.link(aside, LEASE_NAME)
        self._fs.remove(aside)

    def _is_file(self, aside: str, seen: os.stat_result, token: object) -> bool:
        """Whether the file moved to ``aside`` is the one ``seen`` (carrying ``token``, if not None).

        The inode alone is not enough: the file judged stale is unlinked by whoever moved it first, and
        its inode number is then free for that contender's fresh lease (it was, in the test). So the
        modification time and size must match too, and the record's token."""
        try:
            fd = self._fs.open_read(aside)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            same = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size) == (
                seen.st_dev,
                seen.st_ino,
                seen.st_mtime_ns,
                seen.st_size,
            )
            if same and token is not None:
                try:
                    same = Lease._parse(self._fs.full(aside), fd).get("token") == token
                except Unreadable:
                    same = False
            return same
        finally:
            os.close(fd)

    def _lstat(self) -> os.stat_result | None:
        """The lease file's own status (lstat: a symlink's target is never looked at); None if gone."""
        try:
            return self._fs.lstat(LEASE_NAME)
        except OSError:
            return None

    @staticmethod
    def _parse(path: Path, fd: int) -> dict[str, Any]:
        """The record in the open file ``fd``; :class:`Unreadable` if it cannot be read or parsed."""
        try:
            raw = os.read(fd, MAX_LEASE_BYTES + 1)  # a regular file (open_regular): reads it whole
            if len(raw) > MAX_LEASE_BYTES:
                raise ValueError(f"larger than {MAX_LEASE_BYTES} bytes")
            # The fence reads the lease before every commit and delete (twice per save): bytes equal to
            # the last ones parsed are that same record (parsing is a function of the bytes alone; only a
            # record that parsed is remembered), so it is not parsed again. The read itself is never saved.
            last = Lease._last_parsed
            if last is not None and last[0] == raw:
                return dict(last[1])
            data = parse_object(raw, str(path))
        except CorruptRecordError as e:
            raise Unreadable(str(e)) from None
        except (OSError, ValueError) as e:
            raise Unreadable(f"{path}: {e}") from e
        Lease._last_parsed = (raw, dict(data))
        return data

    def _open(self) -> int | None:
        """A descriptor on the current lease file; None if there is none. Unreadable on other errors."""
        try:
            return self._fs.open_read(LEASE_NAME)  # never a symlink, FIFO, directory or device
        except FileNotFoundError:
            return None
        except NotRegularFileError as e:
            raise NotALeaseFile(str(e)) from e
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise NotALeaseFile(f"{self.path} is a symlink, not a regular file") from e
            raise Unreadable(f"{self.path}: {e}") from e

    def _read(self) -> tuple[dict[str, Any], os.stat_result] | None:
        """(the lease record, the file's status: mtime and inode); None if there is no lease file. Raises
        :class:`Unreadable` if it cannot be read or parsed (transient on NFS; a creator mid-write)."""
        fd = self._open()
        if fd is None:
            return None
        try:
            return self._parse(self.path, fd), os.fstat(fd)
        except OSError as e:
            raise Unreadable(f"{self.path}: {e}") from e
        finally:
            os.close(fd)

    def _holder(self) -> dict[str, Any] | None:
        found = self._read()
        return None if found is None else found[0]

    def _renew(self) -> str | None:
        fd = self._open()  # Unreadable: transient, retried by _beat
        if fd is None:
            return (
                f"lease {self.path} was removed (by hand, or by a job that judged it stale); this job no "
                "longer owns the root"
            )
        try:
            holder = self._parse(self.path, fd)
            if holder.get("token") != self.token:
                return f"lease on {self.path.parent} was taken over by {describe_holder(holder)}"
            try:
                # The compare-and-swap: this inode carries our token; touching it through the descriptor
                # can never touch a file a taker linked in since (see the class docstring).
                os.utime(fd)
            except OSError as e:
                raise Unreadable(f"cannot touch {self.path}: {e}") from e
        finally:
            os.close(fd)
        return None

    def _drop(self) -> None:
        """Remove the lease if it is still ours: moved aside first, then removed only if the file moved is
        the very one found carrying our token (a taker's file moved by a race is put back)."""
        try:
            fd = self._open()
            if fd is None:
                return
            try:
                ours = self._parse(self.path, fd).get("token") == self.token
                ident = os.fstat(fd)
            finally:
                os.close(fd)
        except (Unreadable, OSError) as e:
            log.warning("safepoint: not releasing %s: %s (it expires by itself)", self.path, e)
            return
        if not ours:
            return
        aside = f"{LEASE_NAME}.release-{self.token}"
        try:
            self._fs.move(LEASE_NAME, aside)
        except FileNotFoundError:
            return
        if self._is_file(aside, ident, self.token):
            self._fs.remove(aside)
            return
        with contextlib.suppress(OSError):  # a taker's lease: back in place, over nothing
            self._fs.link(aside, LEASE_NAME)
        self._fs.remove(aside)
