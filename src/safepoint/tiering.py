"""tiering: commit to the local tier first, make each checkpoint durable in the background.

``CheckpointManager(root="s3://bucket/run", local_root="/nvme/ckpt")``: saves commit to ``local_root``
exactly as without tiering (training blocks only for that); then an uploader thread copies each committed
checkpoint to ``root`` and commits it there with the store's protocol (data objects confirmed, manifest
last; see remote.py). Every rank uploads its own files (``__<rank>_<n>.distcp``; rank 0 also the rest);
rank 0 writes the manifest once all ranks report their files confirmed. The uploader has its own process
group (created in the manager's ``__init__``) so its collectives never interleave with a save's.

Local retention (``keep_local_last``) never deletes a local copy that is not durable yet, unless durable
retention would not keep it anyway ("superseded": a newer checkpoint made it redundant before it was
uploaded, e.g. ``keep_last=3`` and five checkpoints waiting). Durable retention applies the user's policy
objects (keep_last, keep_every_steps, keep_best) to the durable tier, after each durable commit.

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
from collections.abc import Iterator
from typing import Any

from safepoint.dist import Comm
from safepoint.errors import CheckpointError
from safepoint.history import RECENT_SAVES, SAFETY_FACTOR, TierEstimate, UploadHistory, save_estimate
from safepoint.layout import CheckpointInfo, Layout
from safepoint.manifest import Manifest
from safepoint.policy import Retention
from safepoint.preemption import EmergencyPlan
from safepoint.remote import RemoteLayout
from safepoint.restore import Restorer
from safepoint.retry import UploadError, lower_priority
from safepoint.state import TrainState
from safepoint.tier_transfer import choose_across_tiers, upload_checkpoint
from safepoint.tiers import DurabilityLag, SingleTier, infos

log = logging.getLogger("safepoint")
IDLE_JOIN_S = 1.0
"""How long close() still waits, after the grace, for an idle uploader thread to exit."""


class Tiering(SingleTier):
    """Local tier + durable tier, with a background uploader (one per rank, lock-step by collectives)."""

    def __init__(
        self, local: Layout, durable: RemoteLayout, retention: Retention, keep_local_last: int, comm: Comm
    ) -> None:
        super().__init__(local)
        if isinstance(keep_local_last, bool) or not isinstance(keep_local_last, int) or keep_local_last < 1:
            raise ValueError(f"keep_local_last must be a positive int, got {keep_local_last!r}")
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
        self._deadline: float | None = None  # the grace's end (monotonic): close() waits no longer
        self._gave_up = False  # close() abandoned the upload in flight at the deadline
        # Held across a durable commit (manifest PUT, promote): abandoning waits for it (up to the deadline),
        # and once abandoned no commit starts. So the lease is never given up under a commit.
        self._commit_lock = threading.Lock()
        self._commit_running: int | None = None  # the step whose commit was running when abandoned

    # ---- lifecycle (manager's __init__ / close) ---------------------------------------------------------

    def take_ownership(self, stale_after_s: float) -> list[str]:
        """Rank 0, during the manager's ownership step: lease + cleanup of the durable root, and a scan for
        local checkpoints that never became durable (a previous run died while uploading)."""
        self.durable.ensure_root()
        self._lease = self.durable.lease(stale_after_s)
        if self._lease is not None:
            self._lease.acquire()
        done = [f"durable tier: {line}" for line in self.durable.clean_pending()]
        durable = self._read_durable()
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
        if not todo and self.comm.is_coordinator:
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
        one = self._history.expected()
        basis = f"{SAFETY_FACTOR:g}x the slowest of the last {RECENT_SAVES} uploads"
        if ahead:
            basis += f", behind {ahead} upload(s) in flight or queued"
        durable = None if one is None else one * (ahead + 1)
        return [save_estimate("local", self.local), TierEstimate("durable", durable, basis)]

    def preempted(self, plan: EmergencyPlan | None, deadline: float | None) -> None:
        """After the emergency save: close() waits for uploads until ``deadline`` at most; if the plan left
        the durable tier out, no further upload starts (what is queued stays local-only, like the emergency
        checkpoint, and the next run on this node uploads it)."""
        self._deadline = deadline
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

    def _remaining(self) -> float | None:
        """Seconds until the grace ends (None: no deadline; may be negative)."""
        return None if self._deadline is None else self._deadline - time.monotonic()

    def close(self, *, raise_failure: bool = True) -> None:
        """Let queued and running uploads finish (after a notice: until the grace ends), release the durable
        root (after a notice: only within the grace), raise a failure if asked."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            remaining = self._remaining()
            thread.join(None if remaining is None else max(0.0, remaining))
            if thread.is_alive():
                with self._cv:
                    active = self._busy is not None or bool(self._queue)
                if active:
                    self._abandon()
                else:  # idle, woken by _closing and on its way out: no upload to abandon
                    thread.join(IDLE_JOIN_S)
        self._release_lease()
        if not self._gave_up:  # an abandoned uploader may still be inside one of this group's collectives
            self.comm.destroy()
        if raise_failure:
            self.raise_failure()

    def _release_lease(self) -> None:
        """Give the durable root back; after a notice, waiting no longer than the grace (what is not done by
        then finishes in the background, or the lease expires by itself: lease_stale_after_s, at once for a
        restart on this host). Never under a commit left running at the deadline: that lease only stops."""
        lease, self._lease = self._lease, None
        if lease is None:
            return
        if self._commit_running is not None:
            lease.stop()
            log.warning(
                "safepoint: not releasing the durable root's lease under the commit of step %s (it expires "
                "after lease_stale_after_s; a restart on this host takes it over at once)",
                self._commit_running,
            )
            return
        remaining = self._remaining()
        if not lease.release(timeout=None if remaining is None else max(0.0, remaining)):
            log.warning(
                "safepoint: the durable root's lease was not released by the end of the grace; if the "
                "process exits first, it expires after lease_stale_after_s (a restart on this host takes it "
                "over at once)"
            )

    def _abandon(self) -> None:
        """The grace ends with an upload still running: leave it rather than be SIGKILLed waiting. No new
        request starts (the gate stays shut) and no commit starts, so the durable tier gets nothing from it;
        the next owner deletes the partial objects and uploads the step again from the local copy. A commit
        already running (its manifest PUT, a promote) is waited for until the deadline at most; if it is
        still running then, it is left to finish (it may or may not land) and the lease is not released."""
        remaining = self._remaining()
        got = self._commit_lock.acquire(timeout=max(0.0, remaining) if remaining is not None else -1)
        try:
            with self._cv:
                self._cutoff = self._cutoff or "abandoned at the preemption's grace deadline"
                self._gave_up = True  # checked under the commit lock: no commit starts from here on
                busy = self._busy
                if not got:
                    self._commit_running = busy
            self.durable.store.gate.clear()
            self.durable.store.abandoned.set()
        finally:
            if got:
                self._commit_lock.release()
        if got:
            log.error(
                "safepoint: the grace is over and the upload of step %s is still running: abandoned (nothing "
                "is committed on the durable tier; the next run uploads it again from the local copy)",
                busy,
            )
        else:
            log.error(
                "safepoint: the grace is over while step %s is being committed on the durable tier: the "
                "commit is left running (it may or may not complete before the process exits; the next run "
                "keeps it if it did, and uploads the step again from the local copy if not)",
                busy,
            )

    @contextlib.contextmanager
    def _committing(self) -> Iterator[bool]:
        """Around a durable commit: yields whether it may start (False once abandoned)."""
        with self._commit_lock:
            yield not self._gave_up

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
            if self.comm.is_coordinator:
                self._prune_local()
            return
        t0 = time.perf_counter()
        # Once close() gave up on this upload no commit starts (its lease may be given up or expire).
        manifest = upload_checkpoint(self.comm, self.local, self.durable, step, detail, self._committing)
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
        if self.comm.is_coordinator:
            self._retain_durable()
            self._prune_local()

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
        if step in self.retention.to_delete(history):
            self._done.add((step, manifest.save_id))
            return ("skip", "superseded: durable retention would delete it right away")
        return ("upload", self.durable.new_pending(step, manifest.save_id))

    def _read_durable(self) -> dict[int, tuple[str, CheckpointInfo]]:
        out = {}
        for step in self.durable.committed_steps():
            try:
                m = self.durable.read_manifest(step)
            except CheckpointError as e:
                log.warning("safepoint: durable step %d is unreadable (%s); ignoring it", step, e)
                continue
            out[step] = (m.save_id, self.durable.info(step, m))
        return out

    def _retain_durable(self) -> None:
        try:
            for step in self.retention.to_delete([info for _, info in self._durable.values()]):
                self.durable.remove(step)
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
            steps = self.local.committed_steps()
            with self._cv:
                waiting = set(self._queue) | {self._busy}
            for step in steps[: -self.keep_local_last]:
                try:
                    save_id = self.local.read_manifest(step).save_id
                except CheckpointError:
                    continue
                if step not in waiting and (step, save_id) in self._done:
                    self.local.remove(step)
                    log.info(
                        "safepoint: removed local step %d (durable, keep_local_last=%d)",
                        step,
                        self.keep_local_last,
                    )
        except OSError as e:
            log.warning("safepoint: local retention pass failed (%s)", e)
        finally:
            self._no_prune.release()

    # ---- restore, list, lag -----------------------------------------------------------------------------

    def restore(self, restorer: Restorer, state: TrainState, step: int | None) -> Manifest | None:
        with self._no_prune:  # the uploader must not delete a local copy while it is chosen and loaded
            manifest = choose_across_tiers(restorer, self.local, self.durable, step, self._fetched)
            if manifest is not None:
                restorer.load(manifest, state)
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
