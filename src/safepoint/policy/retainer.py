"""Retention off the save's critical path: rank 0's deleter thread applies the policies after each commit.

A save hands the step it committed to ``Retainer.committed`` and returns; a thread owned by the manager
lists the root, decides from an index (step -> the info of its manifest, kept across saves, so each pass
reads only manifests it has not seen) and deletes. Every delete is fenced by the lease token inside
``remove`` (a manager that lost the root deletes nothing), and each is crash-safe there: a local step is
renamed into ``.pending`` (one atomic rename: listed intact, or not at all) before its files go, an object
store step loses its manifest first; what a kill -9 leaves is an unlisted ``.pending`` entry or unlisted
objects, removed by the next owner's ``clean_pending``.

Never deleted: the step committed last, the newest step restore verified intact, and a step a save is
about to commit (``claim``): a step saved again under the same number must not be removed by a pass that
decided on its old copy. ``drain`` (from ``wait``/``restore``/``close``) waits until every queued pass is
done.

Retention stops for good when the lease is lost (the first fenced delete says so; nothing more is tried)
and on a preemption notice (``abandon``: queued passes are dropped, a running one stops after the step it is
deleting, so the emergency save and the exit wait on one step's delete at most). What is left undeleted is
judged again by the next owner's first save, whose pass lists the whole root.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from safepoint import events as ev
from safepoint.errors import CheckpointError, LeaseError, LeaseUnconfirmed
from safepoint.policy.rules import Retention, Verdicts
from safepoint.store.posix_layout import CheckpointInfo, CheckpointStore, Layout
from safepoint.store.shared_files import file_identities

log = logging.getLogger("safepoint")


class Retainer:
    events: ev.Events = ev.NO_EVENTS  # the manager's stream (events.py): each step deleted

    def __init__(
        self, layout: CheckpointStore, retention: Retention, verdicts: Verdicts, *, background: bool = False
    ) -> None:
        self.layout, self.retention, self.verdicts = layout, retention, verdicts
        # True (the manager's default, ClusterOptions.background_deletes): passes run on the deleter thread,
        # which close() stops. False (a bare saver's: no thread to stop): each runs in the saving thread
        # once the save's verdict is out (``settle``), so rank 0 alone is late for the next collective.
        self.background = background
        self._index: dict[int, CheckpointInfo] = {}  # retention's view of the root, kept across passes
        # The file names each indexed step's manifest lists (keep_fallback): read once per index entry, not
        # once per step per pass (two manifest parses per save were most of a small save's pass). Safe: a
        # committed manifest never changes under the same index entry (a step saved again replaces the
        # entry, and its names go with it); the files' identities are still stat'ed afresh every pass.
        self._names: dict[int, tuple[str, ...]] = {}
        self._cond = threading.Condition()
        self._queue: list[tuple[int, CheckpointInfo | None]] = []  # commits not yet seen by a pass
        self._given: dict[int, tuple[str, ...]] = {}  # the file names of queued commits, from their saver
        self._claimed: set[int] = set()  # steps a save is committing right now
        self._deleting: int | None = None
        self._busy = False  # a pass is running
        self._closed = False
        self._stopped = False  # the lease was lost, or a preemption notice came: no pass runs any more
        self._thread: threading.Thread | None = None
        self.pause: Callable[[], None] = lambda: None
        """The pause point of a background pass (set by the manager: save/foreground.py)."""
        self.keep_fallback = False
        """Incremental saves with full copies: also keep the newest step that shares no file (inode) with
        the newest step, so one damaged shared file always leaves an intact step (docs/reliability.md)."""

    @property
    def in_background(self) -> bool:
        """Whether passes run on the deleter thread (a process ending without close() waits for them)."""
        return self.background and bool(self.retention.policies)

    def claim(self, step: int) -> None:
        """Called before committing ``step``: no pass deletes it from now on (waits only if that very
        step number is being deleted this moment, so the new copy never lands under a delete)."""
        if not self.retention.policies:
            return
        with self._cond:
            self._claimed.add(step)
            while self._deleting == step:
                self._cond.wait()

    def committed(self, step: int, info: CheckpointInfo | None, names: tuple[str, ...] | None = None) -> None:
        """After the commit of ``step`` (``info``), or its failure (None): queue a retention pass. ``names``:
        the files its manifest lists (the saver has it in hand: the pass then does not read it back)."""
        if not self.retention.policies:
            return
        with self._cond:
            if self._closed or self._stopped:
                self._claimed.discard(step)
                return
            self._queue.append((step, info))
            if names is not None and info is not None:
                self._given[step] = names
            if not self.background:
                return  # settle() runs it
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="safepoint-retention", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def settle(self) -> None:
        """Inline mode: run the queued pass now, in the calling (saving) thread. Background: nothing."""
        if self.background:
            return
        with self._cond:
            while self._busy:
                self._cond.wait()
            if not self._queue:
                return
            batch, self._queue = self._queue, []
            self._busy = True
        self._process(batch)

    def drain(self) -> None:
        """Wait until every queued pass has run (its deletes done or failed and logged)."""
        self.settle()
        with self._cond:
            while self._queue or self._busy:
                self._cond.wait()

    def abandon(self) -> None:
        """A preemption notice: drop the queued passes and stop a running one after the step it is deleting
        (each step's delete is crash-safe on its own; see the module docstring). Returns at once."""
        with self._cond:
            self._stopped = True
            self._queue.clear()
            self._given.clear()
            self._cond.notify_all()

    def close(self) -> None:
        """Drain, then stop the thread. Later commits are not retained (the manager is closing)."""
        self.settle()
        with self._cond:
            while self._queue or self._busy:
                self._cond.wait()
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed and not self._stopped:
                    self._cond.wait()
                if not self._queue:
                    return  # closed, or stopped: the thread ends (``committed`` starts no other)
                batch, self._queue = self._queue, []
                self._busy = True
            self._process(batch)

    def _process(self, batch: list[tuple[int, CheckpointInfo | None]]) -> None:
        """One pass over what ``batch`` committed; ``_busy`` was set by the caller, cleared here."""
        with self._cond:
            for step, _ in batch:
                self._claimed.discard(step)
            given = {step: self._given.pop(step) for step, _ in batch if step in self._given}
        try:
            if self.background:
                # On the deleter thread: wait while the training thread writes a save beside a background
                # one (save/foreground.py). Safe here: no lock held and no step being deleted, so claim()
                # and settle() never wait for this thread. (Inline, the saving thread runs this pass.)
                self.pause()
            newest = [(s, i) for s, i in batch if i is not None]
            for s, i in newest:
                self._index[s] = i
                self._names.pop(s, None)
                if s in given:  # the manifest just committed lists these: not read back from disk
                    self._names[s] = given[s]
            if newest:  # a failed save changes nothing on disk worth a pass
                self._pass(newest[-1][0])
        except Exception as e:  # a bug here must not kill the thread and hang drain()
            log.warning("safepoint: retention pass failed (%s); will retry after the next save", e)
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _apart_from_newest(self, history: list[CheckpointInfo]) -> int | None:
        """The newest step sharing no file with the newest one, if the newest shares files at all (None:
        it shares none, so any other step is apart already, or there are no files to tell by)."""
        if not isinstance(self.layout, Layout) or len(history) < 3:
            # Only a local layout hard-links files between steps. And the answer needs a step that shares
            # a file with the newest and one that shares none: two steps besides it. With one (keep last 1:
            # every pass) it is None whether they share or not, so their files are not stat'ed for it.
            return None

        def identities(step: int) -> set[tuple[int, int]]:
            if step not in self._names:
                try:
                    self._names[step] = tuple(self.layout.read_manifest(step).files)
                except CheckpointError:
                    return set()  # unreadable: not cached, read again next pass
            return file_identities(self.layout, step, self._names[step])

        steps = sorted((c.step for c in history), reverse=True)
        newest = identities(steps[0])
        others = [(step, identities(step)) for step in steps[1:]]
        if all(newest.isdisjoint(ids) for _, ids in others):
            return None
        return next((step for step, ids in others if newest.isdisjoint(ids)), None)

    def _pass(self, committed: int) -> None:
        """Apply the policies; ``committed`` (the last commit) and the newest verified step survive."""
        t0 = time.perf_counter()
        try:
            steps = self.layout.committed_steps()
            for s in list(self._index):
                if s not in steps:
                    del self._index[s]  # removed (by us, by prune, by hand)
                    self._names.pop(s, None)
            history = []
            for s in steps:
                if self.verdicts.corrupt(s):
                    continue  # never counted as the newest, as kept or as deleted
                if s not in self._index:
                    try:
                        self._index[s] = self.layout.info(s, self.layout.read_manifest(s))
                    except CheckpointError:
                        continue  # unreadable manifests are never counted as kept or deleted
                history.append(self._index[s])
            good = self.verdicts.newest_intact([c.step for c in history])
            protect = {committed} | ({good} if good is not None else set())
            if self.keep_fallback and (apart := self._apart_from_newest(history)) is not None:
                protect.add(apart)
            doomed, deciding = self.retention.to_delete(history, protect), time.perf_counter() - t0
            for step in doomed:
                if self.background:
                    self.pause()  # as in _process: no lock held, no step being deleted
                with self._cond:
                    if self._stopped:
                        return  # abandoned: the next owner's first pass judges what is left
                    if step in self._claimed:
                        continue  # being saved again: its new copy is not what this pass judged
                    self._deleting = step
                try:
                    self.layout.remove(step)  # fenced by the lease token, crash-safe (module docstring)
                finally:
                    with self._cond:
                        self._deleting = None
                        self._cond.notify_all()
                self._index.pop(step, None)
                log.info("safepoint: retention removed step %d", step)
                self.events.emit(ev.SAVE_DELETED, step, tier="root", get_old_steps_duration_secs=deciding)
        except LeaseUnconfirmed as e:
            # The lease could not be read (the store failing): not proof of another owner. Retried after
            # the next save, whose commit fences again; stopping here would stop retention for good.
            log.warning("safepoint: retention pass failed (%s); will retry after the next save", e)
        except LeaseError as e:
            # Another owner has the root: every later delete would be refused as well (and must be).
            with self._cond:
                self._stopped = True
                self._queue.clear()
                self._given.clear()
                self._cond.notify_all()
            log.error("safepoint: retention stopped: %s", e)
        except (OSError, CheckpointError) as e:
            # The new checkpoint is committed; a failed cleanup costs space, not correctness.
            log.warning("safepoint: retention pass failed (%s); will retry after the next save", e)
