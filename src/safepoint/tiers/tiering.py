"""tiering: commit to the local tier first, make each checkpoint durable in the background.

``CheckpointManager(root="s3://bucket/run", local_root="/nvme/ckpt")``: saves commit to ``local_root``
exactly as without tiering (training blocks only for that); then an uploader thread copies each committed
checkpoint to ``root`` and commits it there with the store's protocol (data objects confirmed, manifest
last; see remote.py). Every rank uploads its own files (``__<rank>_<n>.distcp``; rank 0 also the rest);
rank 0 writes the manifest once all ranks report their files confirmed. The uploader has its own process
group (created in the manager's ``__init__``) so its collectives never interleave with a save's.

Local retention (``Keep.local_last``) never deletes a local copy that is not durable yet, unless durable
retention would not keep it anyway ("superseded": a newer checkpoint made it redundant before it was
uploaded, e.g. ``Keep(last=3)`` and five checkpoints waiting). Durable retention applies the user's policy
objects (``Keep(last=, every_steps=, best=)``) to the durable tier, after each durable commit.

Restore takes the newest intact checkpoint of either tier (tier_transfer.py). On a preemption the
emergency save is planned with both tiers' estimates (local saves from the manifests, uploads from
``.uploads.json``); one whose upload does not fit in the grace stays local-only until the next run.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from safepoint.dist import Comm
from safepoint.errors import CheckpointError
from safepoint.events import SAVE_DELETED, SAVE_DURABLE, durable
from safepoint.options import check_keep_local_last
from safepoint.policy.emergency_plan import EmergencyPlan
from safepoint.policy.history import TierEstimate, UploadHistory, save_estimate
from safepoint.policy.rules import Retention, Verdicts
from safepoint.remote.object_layout import RemoteLayout
from safepoint.remote.retry import UploadError, lower_priority
from safepoint.restore.restorer import Restorer
from safepoint.state import TrainState
from safepoint.store.manifest import Manifest
from safepoint.store.posix_layout import CheckpointInfo, Layout
from safepoint.tiers.base import (
    DurabilityLag,
    SingleTier,
    drop_node_shares,
    infos,
    prune_local,
    read_durable,
)
from safepoint.tiers.grace import UploadGrace
from safepoint.tiers.transfer import choose_across_tiers, upload_checkpoint

log = logging.getLogger("safepoint")
IDLE_JOIN_S = 1.0
"""How long close() still waits, after the grace, for an idle uploader thread to exit."""


class Tiering(SingleTier):
    """Local tier + durable tier, with a background uploader (one per rank, lock-step by collectives)."""

    per_node = False  # True in tiers/node_tiers.py: each node has its own local tier

    def __init__(
        self,
        local: Layout,
        durable: RemoteLayout,
        retention: Retention,
        keep_local_last: int,
        comm: Comm,
        verdicts: Verdicts | None = None,
    ) -> None:
        super().__init__(local)
        # What restore verified (shared with the restorer): durable retention keeps the newest intact step
        # and never counts a corrupt one as the newest, kept or deleted, like local retention (save/saver.py).
        self.verdicts = verdicts if verdicts is not None else Verdicts()
        check_keep_local_last(keep_local_last)
        self.local, self.durable, self.retention = local, durable, retention
        self.keep_local_last, self.comm = keep_local_last, comm
        self._cv = threading.Condition()
        self._queue: collections.deque[int] = collections.deque()
        self._busy: int | None = None
        self._closing = False
        self._pauses = 0
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        # step -> (save_id, info) of what the durable tier holds (as far as this process knows)
        self._durable: dict[int, tuple[str, CheckpointInfo]] = {}
        self._done: set[tuple[int, str]] = set()  # (step, save_id) that need no upload: local copy may go
        self._no_prune = threading.Lock()  # held while restoring: the uploader must not delete under it
        self._lease: Any = None
        self._scan: tuple[list[int], dict[int, tuple[str, CheckpointInfo]]] = ([], {})
        self.uploaded: list[int] = []
        self._history = UploadHistory(local.root)
        # Committed locally, not queued: the preemption's grace left no time to upload them (next run does).
        self._local_only: set[int] = set()
        self._cutoff: str | None = None  # set on a preemption whose plan skips the durable tier
        self._grace = UploadGrace(self._cv, durable.store.gate, durable.store.abandoned)

    # ---- lifecycle (manager's __init__ / close) ---------------------------------------------------------

    def take_ownership(self, stale_after_s: float, job: str | None = None) -> list[str]:
        """Rank 0, during the manager's ownership step: lease + cleanup of the durable root, and a scan for
        local checkpoints that never became durable (a previous run died while uploading)."""
        self.durable.ensure_root()
        self._lease = self.durable.lease(stale_after_s, job)
        if self._lease is not None:
            self._lease.acquire()
        done = [f"durable tier: {line}" for line in self.durable.clean_pending()]
        durable = read_durable(self.durable)
        if not self.per_node:  # one node now: shares saved by several nodes are of no use
            done.extend(drop_node_shares(self.local, durable))
        todo = []
        for step in self.local.committed_steps():
            try:
                save_id = self.local.read_manifest(step).save_id
            except CheckpointError:
                continue
            if durable.get(step, ("",))[0] != save_id:
                todo.append(step)
        self._scan = (todo, durable)
        if todo:
            done.append(f"will upload local checkpoint(s) {todo} that are not durable yet")
        return done

    def start(self) -> None:
        """Collective (uploader group): every rank learns rank 0's scan and queues the same steps."""
        todo, durable = self.comm.broadcast(self._scan if self.comm.is_coordinator else ([], {}))
        self._durable = dict(durable)
        for step, (save_id, _) in durable.items():
            self._done.add((step, save_id))
        for step in todo:
            self._enqueue(step)
        if not todo and self._prunes:
            self._prune_local()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Requests not yet started wait while a save blocks training (those in flight finish): on a
        busy machine the upload's CPU and memory traffic would otherwise lengthen the save."""
        with self._cv:
            self._pauses += 1
            self.durable.store.gate.clear()
        try:
            yield
        finally:
            with self._cv:
                self._pauses -= 1
                if not self._pauses:
                    self.durable.store.gate.set()

    def committed(self, info: CheckpointInfo, *, upload: bool = True) -> CheckpointInfo:
        """A checkpoint was committed locally (called on every rank, in the same order): queue it, or with
        ``upload=False`` (an emergency save whose upload does not fit in the grace) keep it local-only."""
        self.observe(info.step)
        if upload:
            self._enqueue(info.step)
        else:
            with self._cv:
                self._local_only.add(info.step)
        return info

    # ---- preemption -------------------------------------------------------------------------------------

    def estimates(self) -> list[TierEstimate]:
        """local: from the local manifests' save timings; durable: from recorded uploads, times the uploads
        it would queue behind (uploads go in commit order, so the emergency one waits for those)."""
        with self._cv:
            ahead = len(self._queue) + (self._busy is not None)
        return [save_estimate("local", self.local), self._history.estimate(ahead)]

    def preempted(self, plan: EmergencyPlan | None, deadline: float | None) -> None:
        """After the emergency save: close() waits for uploads until ``deadline`` at most; if the plan left
        the durable tier out, no further upload starts (what is queued stays local-only, like the emergency
        checkpoint, and the next run on this node uploads it)."""
        self._grace.deadline = deadline
        if plan is None or plan.action == "full":
            return
        with self._cv:
            self._cutoff = f"the preemption's grace leaves no time to upload it ({plan.action} plan)"
            queued, busy, local_only = list(self._queue), self._busy, sorted(self._local_only)
        if not (local_only or queued or busy is not None):
            return  # nothing saved, nothing waiting: the skip plan's own log says it all
        log.warning(
            "safepoint: preempted with too little grace to upload: not uploading step(s) %s%s%s. They stay "
            "on the local tier only (%s; durability_lag() counts them): a restart on this node restores "
            "from there and uploads them; a restart elsewhere resumes from the newest durable checkpoint "
            "(step %s).",
            local_only or "-",
            f", nor the queued step(s) {queued}" if queued else "",
            "" if busy is None else f"; the upload of step {busy} in flight may run until the deadline",
            self.local.root,
            self.lag().durable_step,
        )

    def _enqueue(self, step: int) -> None:
        with self._cv:
            self._queue.append(step)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="safepoint-upload", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def wait(self) -> None:
        with self._cv:
            while self._queue or self._busy is not None:
                self._cv.wait()

    def raise_failure(self) -> None:
        """Raise (once) an upload failure; a lost durable lease too."""
        with self._cv:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
        if self._lease is not None:
            self._lease.check()

    def close(self, *, raise_failure: bool = True, before_release: Callable[[], None] | None = None) -> None:
        """Let queued and running uploads finish (after a notice: until the grace ends), ``before_release``
        (last writes under the lease), release the durable root (after a notice: in the grace), raise."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            remaining = self._grace.remaining()
            thread.join(None if remaining is None else max(0.0, remaining))
            if thread.is_alive():
                with self._cv:
                    active = self._busy is not None or bool(self._queue)
                if active:
                    self._grace.abandon(self._stop_uploads)
                else:  # idle, woken by _closing and on its way out: no upload to abandon
                    thread.join(IDLE_JOIN_S)
        if before_release is not None:
            before_release()
        lease, self._lease = self._lease, None
        self._grace.release_lease(lease)
        # An abandoned uploader may still be inside one of this group's collectives: never destroy it then.
        if not self._grace.gave_up:
            self.comm.destroy()
        if raise_failure:
            self.raise_failure()

    def _stop_uploads(self) -> int | None:
        """Under ``_cv``, on an abandon: no further upload starts. Returns the step in flight."""
        self._cutoff = self._cutoff or "abandoned at the preemption's grace deadline"
        return self._busy

    # ---- the uploader thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        if self.durable.store.cfg.background:
            lower_priority()
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue:
                    self._thread = None
                    return
                step = self._busy = self._queue.popleft()
            try:
                self._upload(step)
            except BaseException as e:  # every failure must reach the user
                log.error("safepoint: upload of step %d failed: %s", step, e)
                with self._cv:
                    self._failure = (
                        e if isinstance(e, CheckpointError) else UploadError(f"upload of step {step}: {e!r}")
                    )
            finally:
                with self._cv:
                    self._busy = None
                    self._cv.notify_all()

    def _upload(self, step: int) -> None:
        """Collective on the uploader group: same steps, same order, same collectives on every rank."""
        decision: tuple[str, str] = ("error", "")
        if self.comm.is_coordinator:
            try:
                decision = self._decide(step)
            except (CheckpointError, OSError) as e:
                decision = ("error", str(e))
        kind, detail = self.comm.broadcast(decision)
        if kind == "error":
            raise UploadError(f"cannot upload step {step} to {self.durable.root}: {detail}")
        if kind == "later":
            log.warning("safepoint: not uploading step %d: %s; it stays local-only", step, detail)
            with self._cv:
                self._local_only.add(step)
            return
        if kind != "upload":
            log.info("safepoint: not uploading step %d: %s", step, detail)
            if self._prunes:
                self._prune_local()
            return
        t0 = time.perf_counter()
        # Once close() gave up on this upload no commit starts (its lease may be given up or expire).
        manifest = self._move(step, detail)
        info = self.durable.info(step, manifest)
        self._history.record(time.perf_counter() - t0, persist=self.comm.is_coordinator)
        with self._cv:
            self._durable[step] = (manifest.save_id, info)
            self._done.add((step, manifest.save_id))
            self._local_only.discard(step)
            self.uploaded.append(step)
        log.info(
            "safepoint: step %d is durable at %s (%.1f MB in %.2fs)",
            step,
            info.path,
            manifest.total_bytes / 1e6,
            time.perf_counter() - t0,
        )
        self.events.emit(SAVE_DURABLE, step, tier="durable", **durable(info, t0, manifest.time))
        if self.comm.is_coordinator:
            self._retain_durable(step)
        if self._prunes:
            self._prune_local()

    def _move(self, step: int, pending: str) -> Manifest:
        return upload_checkpoint(self.comm, self.local, self.durable, step, pending, self._grace.committing)

    @property
    def _prunes(self) -> bool:
        """This rank prunes the local tier it sees (rank 0; with per-node tiers, each node's leader)."""
        return self.comm.is_coordinator

    def _decide(self, step: int) -> tuple[str, str]:
        try:
            manifest = self.local.read_manifest(step)
        except CheckpointError:
            return ("skip", "it is no longer committed locally")
        if self._durable.get(step, ("",))[0] == manifest.save_id:
            return ("done", "it is durable already")
        if self._cutoff is not None:
            return ("later", self._cutoff)
        with self._cv:
            queued = list(self._queue)
        waiting = []
        for s in (s for s in queued if s != step):
            with contextlib.suppress(CheckpointError):  # an unreadable one is decided on its own turn
                waiting.append(self.local.info(s, self.local.read_manifest(s)))
        history = [info for _, info in self._durable.values()] + waiting + [self.local.info(step, manifest)]
        history = [c for c in history if not self.verdicts.corrupt(c.step)]
        if step in self.retention.to_delete(history, self._protected(history, max(c.step for c in history))):
            self._done.add((step, manifest.save_id))
            return ("skip", "superseded: durable retention would delete it right away")
        return ("upload", self.durable.new_pending(step, manifest.save_id))

    def _protected(self, history: list[CheckpointInfo], newest: int) -> set[int]:
        good = self.verdicts.newest_intact([c.step for c in history])
        return {newest} | ({good} if good is not None else set())

    def _retain_durable(self, uploaded: int) -> None:
        """The policies on the durable tier; the step just uploaded and the newest verified one survive."""
        try:
            history = [info for _, info in self._durable.values() if not self.verdicts.corrupt(info.step)]
            for step in self.retention.to_delete(history, self._protected(history, uploaded)):
                self.durable.remove(step)
                self.events.emit(SAVE_DELETED, step, tier="durable")
                with self._cv:
                    self._durable.pop(step, None)
                log.info("safepoint: durable retention removed step %d", step)
        except (CheckpointError, OSError) as e:
            log.warning("safepoint: durable retention pass failed (%s); will retry after the next upload", e)

    def _prune_local(self) -> None:
        """keep_local_last, but never a copy that still needs uploading (nor under a restore)."""
        if not self._no_prune.acquire(blocking=False):
            return
        try:
            prune_local(self.local, self.keep_local_last, self._waiting, self._done, self.events)
        finally:
            self._no_prune.release()

    def _waiting(self) -> set[int | None]:
        with self._cv:
            return set(self._queue) | {self._busy}

    # ---- restore, list, lag -----------------------------------------------------------------------------

    def restore(self, restorer: Restorer, state: TrainState, step: int | None) -> Manifest | None:
        with self._no_prune:  # the uploader must not delete a local copy while it is chosen and loaded
            manifest = restorer.restore(
                state,
                step,
                lambda below: choose_across_tiers(
                    restorer, self.local, self.durable, step, self._fetched, below
                ),
            )
            if manifest is not None:
                self.observe(manifest.step)
        return manifest

    def _fetched(self, manifest: Manifest) -> None:
        """A durable checkpoint was downloaded into the local tier: it needs no upload."""
        with self._cv:
            self._durable[manifest.step] = (manifest.save_id, self.durable.info(manifest.step, manifest))
            self._done.add((manifest.step, manifest.save_id))

    def list(self) -> list[CheckpointInfo]:
        """Both tiers, oldest first; a step present locally is listed with its local path."""
        local = {i.step: i for i in infos(self.local)}
        durable = {i.step: i for i in infos(self.durable)}
        return [local.get(s) or durable[s] for s in sorted(local.keys() | durable.keys())]

    def resume_step(self) -> int | None:
        """The newest committed step this process knows of, without touching the durable store (used within
        the grace): local committed steps (a directory listing) and the durable steps already known."""
        with self._cv:
            steps = set(self._durable)
        with contextlib.suppress(OSError, CheckpointError):
            steps.update(self.local.committed_steps())
        return max(steps) if steps else None

    def lag(self) -> DurabilityLag:
        with self._cv:
            infos = [info for _, info in self._durable.values()]
            pending = len(self._queue) + (self._busy is not None) + len(self._local_only)
        return self._lag(max(infos, key=lambda i: i.step) if infos else None, pending)
