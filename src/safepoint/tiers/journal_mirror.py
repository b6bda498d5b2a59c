"""The run journal of a URL root: ``ROOT/.run/`` on the object store, so ``safepoint report s3://...`` works.

The journal (journal.py), the attempts file (history.py) and the progress file are local files, appended
and rewritten in place, which an object store cannot do. Rank 0 of the root's owner keeps them in a local
directory (``local_root`` with tiering; otherwise a private temporary directory) and a :class:`JournalMirror`
copies them to the store as whole objects (one PUT each: an object write is atomic, a reader sees the old
copy or the new one, never half of one):

- after the events the report counts (a commit, a durable upload, a restore, a failure),
  and every ``interval_s`` otherwise (the loop's progress; unchanged files are not put again), throttled
  to one copy per ``interval_s``, on the mirror's own thread: never on the training thread, and
  a slow or failing store delays the copy, never a save (a failed copy is logged once; the next one retries);
- at the manager's close, after the attempt's end is recorded: the final copy (the progress object is
  deleted then, as the local file is);
- at the manager's start, before the attempt is recorded: a local file that is missing (a fresh temporary
  directory, a new node's empty local disk) is seeded from the store, so each restart appends to the same
  journal and finds the progress a killed attempt left in its last copy.

After a preemption notice nothing more is copied (the grace is the emergency save's): the report of a
preempted attempt ends at the copy before the notice. A kill -9 loses what happened since the last copy
(at most ``interval_s`` of events, and the steps reached since): the report undercounts, never invents.
Reading (``fetch_run_files``) treats the objects as hostile: each is listed first and refused above its
cap, then parsed by the same validating readers as a local root.
"""

from __future__ import annotations

import logging
import math
import posixpath
import tempfile
import threading
import time
from pathlib import Path

from safepoint import events as ev
from safepoint.dist import Comm
from safepoint.errors import LeaseError
from safepoint.policy.history import ATTEMPTS_NAME, RunHistory
from safepoint.policy.journal import JOURNAL_NAME, MAX_JOURNAL_BYTES, PROGRESS_NAME, Journal, open_records
from safepoint.remote.object_layout import RemoteLayout
from safepoint.remote.upload import UploadError
from safepoint.store.posix_layout import CheckpointStore, Layout
from safepoint.store.rootfs import RootDir

log = logging.getLogger("safepoint")
RUN_PREFIX = ".run"
# Each copied file and the largest object of that name a reader accepts (a planted huge object is refused).
CAPS = {JOURNAL_NAME: 2 * MAX_JOURNAL_BYTES, ATTEMPTS_NAME: 4 << 20, PROGRESS_NAME: 4096}
TRIGGERS = frozenset({ev.SAVE_COMMITTED, ev.SAVE_DURABLE, ev.SAVE_FAILED, ev.RESTORE})
DEFAULT_INTERVAL_S = 30.0


def _key(remote: RemoteLayout, name: str) -> str:
    return posixpath.join(remote.base, RUN_PREFIX, name)


def fetch_run_files(remote: RemoteLayout, into: Path) -> list[str]:
    """Download ROOT/.run/'s objects into the directory ``into`` (each refused above its cap: OSError);
    returns the names found."""
    try:
        sizes = remote.store.sizes(posixpath.join(remote.base, RUN_PREFIX))
    except UploadError as e:
        raise OSError(str(e)) from None
    fs, found = RootDir(into), []
    for name, cap in CAPS.items():
        if name not in sizes:
            continue
        if sizes[name] > cap:
            raise OSError(f"{remote.root}/{RUN_PREFIX}/{name} is {sizes[name]} bytes, over the {cap} cap")
        try:
            data = remote.store.get_bytes(_key(remote, name))
        except UploadError as e:
            raise OSError(str(e)) from None
        if len(data) > cap:  # replaced by a larger object since the listing
            raise OSError(f"{remote.root}/{RUN_PREFIX}/{name} is over the {cap} byte cap")
        fs.write(name, data, durable=False)
        found.append(name)
    return found


class JournalMirror:
    """Rank 0's copier of the run files of ``spool`` to ``remote``/.run/ (an event sink with a close)."""

    def __init__(
        self,
        spool: Path,
        remote: RemoteLayout,
        *,
        interval_s: float | None = None,
        temporary: tempfile.TemporaryDirectory[str] | None = None,
    ) -> None:
        """``interval_s``: the least time between two copies (None: ``DEFAULT_INTERVAL_S``, read now);
        ``temporary``: ``spool``'s own temporary directory, removed at :meth:`close`."""
        self.spool, self.remote, self.temporary = spool, remote, temporary
        self.interval_s = DEFAULT_INTERVAL_S if interval_s is None else interval_s
        self.fs = RootDir(spool)
        self._wake, self._stop = threading.Event(), threading.Event()
        # No copy yet: the first one is never throttled. (Not 0.0: time.monotonic() counts from the boot,
        # so on a machine up for less than interval_s a 0.0 held the first copy back for the rest of it.)
        self._last = -math.inf
        self._warned = False
        self._preempted = False
        self._copied: dict[str, bytes] = {}  # what the store holds of each file (as this mirror put it)
        self._thread: threading.Thread | None = None

    @classmethod
    def for_root(cls, local: Path | None, remote: RemoteLayout) -> JournalMirror:
        """The mirror of ``local`` (``local_root``), or of a fresh temporary directory when there is none."""
        if local is not None:
            return cls(local, remote)
        tmp = tempfile.TemporaryDirectory(prefix="safepoint-run-")
        return cls(Path(tmp.name), remote, temporary=tmp)

    def seed(self) -> None:
        """Before the journal and the attempts file are opened: copy down the run files missing locally."""
        missing = [name for name in CAPS if not self.fs.lexists(name)]
        if not missing:
            return
        with tempfile.TemporaryDirectory(prefix="safepoint-seed-") as tmp:
            try:
                found = fetch_run_files(self.remote, Path(tmp))
            except OSError as e:
                log.warning("safepoint: the run journal in %s/%s starts over (%s)", self.remote.root,
                            RUN_PREFIX, e)  # fmt: skip
                return
            src = RootDir(tmp)
            for name in found:
                if name in missing:
                    try:
                        self.fs.write(name, src.read(name, CAPS[name]))
                    except OSError as e:  # advisory: this attempt's journal starts without it
                        log.warning("safepoint: cannot seed %s from %s (%s)", name, self.remote.root, e)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="safepoint-journal-mirror", daemon=True)
        self._thread.start()

    def __call__(self, event: ev.CheckpointEvent) -> None:
        if event.rank == 0 and event.event_type in (ev.PREEMPTION, ev.EMERGENCY_SAVE):
            # The grace is for the emergency save and its upload: no copy from here on, not even the final
            # one (a slow or unreachable store would eat the grace); the last copy stands.
            self._preempted = True
        if event.rank == 0 and event.event_type in TRIGGERS:
            self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            # An event the report counts, or the interval: the loop's progress moves without events, and a
            # kill -9 loses only the steps since the last copy.
            self._wake.wait(self.interval_s)
            if self._stop.is_set():
                return
            # Throttled: at most one copy per interval (events in between ride on the next one).
            if self._stop.wait(max(0.0, self._last + self.interval_s - time.monotonic())):
                return
            self._wake.clear()
            if self._preempted:
                return
            self.copy()

    def copy(self, *, final: bool = False) -> None:
        """Put each run file as one object (atomic); at the end, the progress object goes as the file did."""
        self._last = time.monotonic()
        try:
            # Under the root's lease, like every write to it: a job that lost the root copies nothing.
            self.remote.fence(f"copying the run journal to {self.remote.root}")
            for name, cap in CAPS.items():
                try:
                    data = self.fs.read(name, cap)
                except FileNotFoundError:
                    if final and name == PROGRESS_NAME:
                        self.remote.store.delete([_key(self.remote, name)])
                    continue
                if self._copied.get(name) != data:  # unchanged files are not put again
                    self.remote.store.put_bytes(_key(self.remote, name), data)
                    self._copied[name] = data
        except (
            OSError,
            UploadError,
            LeaseError,
        ) as e:  # advisory, like the journal: the next copy tries again
            if not self._warned:
                self._warned = True
                log.warning("safepoint: copying the run journal to %s/%s failed (%s); will retry",
                            self.remote.root, RUN_PREFIX, e)  # fmt: skip

    def close(self) -> None:
        """The final copy (the journal and the attempts file were closed just before), then clean up."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        if not self._preempted:
            self.copy(final=True)
        if self.temporary is not None:
            self.temporary.cleanup()


def open_runs(
    layout: CheckpointStore, durable: RemoteLayout | None, comm: Comm, read_only: object, events: ev.Events
) -> tuple[RunHistory | None, Journal]:
    """journal.open_records, plus the mirror on rank 0 of the owner of a URL root (with or without
    ``local_root``): seeded before the attempt is recorded, subscribed after the journal (so the final
    copy, at the events' close, comes after the journal's and the attempts file's last writes)."""
    remote = durable if durable is not None else layout if isinstance(layout, RemoteLayout) else None
    if remote is None or not comm.is_coordinator or read_only:
        return open_records(layout, comm, read_only, events)
    mirror = JournalMirror.for_root(layout.root if isinstance(layout, Layout) else None, remote)
    mirror.seed()
    runs, journal = open_records(layout if isinstance(layout, Layout) else Layout(mirror.spool), comm,
                                 read_only, events)  # fmt: skip
    events.subscribe(mirror)
    mirror.start()
    return runs, journal
