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

Restore takes the newest intact checkpoint of either tier: the local one if it verifies, else a newer or
intact durable one, downloaded into the local tier first (crc32c checked as the bytes arrive, committed
locally with the local protocol), then loaded from local disk.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import re
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from safepoint.dist import Comm
from safepoint.errors import CheckpointError, CorruptCheckpointError
from safepoint.layout import CheckpointInfo, Layout
from safepoint.manifest import Manifest
from safepoint.policy import Retention
from safepoint.remote import RemoteLayout
from safepoint.restore import CheckpointWarning, Restorer
from safepoint.retry import UploadError, lower_priority
from safepoint.state import TrainState
from safepoint.tiers import DurabilityLag, SingleTier, infos

log = logging.getLogger("safepoint")
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


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

    def committed(self, info: CheckpointInfo) -> CheckpointInfo:
        """A checkpoint was committed locally (called on every rank, in the same order): queue it."""
        self.observe(info.step)
        self._enqueue(info.step)
        return info

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

    def close(self, *, raise_failure: bool = True) -> None:
        """Let queued and running uploads finish, release the durable root, raise a failure if asked."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        self.comm.destroy()
        if raise_failure:
            self.raise_failure()

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
        if kind != "upload":
            log.info("safepoint: not uploading step %d: %s", step, detail)
            if self.comm.is_coordinator:
                self._prune_local()
            return
        pending, t0 = detail, time.perf_counter()
        error: str | None = None
        manifest: Manifest | None = None
        try:
            manifest = self.local.read_manifest(step)
            base = self.local.step_path(step)
            mine = [n for n in sorted(manifest.files) if self._owner(n) == self.comm.rank]
            files = [(str(base / n), n, manifest.files[n].size, manifest.files[n].crc32c) for n in mine]
            self.durable.put_files(pending, files)
        except (CheckpointError, OSError) as e:
            error = f"rank {self.comm.rank}: {e}"
        errors = [e for e in self.comm.all_gather(error) if e]
        if self.comm.is_coordinator:
            if not errors and manifest is not None:
                try:
                    self.durable.commit(pending, manifest)
                except (CheckpointError, OSError) as e:
                    errors.append(f"commit: {e}")
            if errors:
                self.durable.discard(pending)
        errors = self.comm.broadcast(errors)
        if errors or manifest is None:
            raise UploadError(
                f"upload of step {step} to {self.durable.root} failed; nothing was committed there and the "
                f"local copy is kept ({'; '.join(errors)})"
            )
        info = self.durable.info(step, manifest)
        with self._cv:
            self._durable[step] = (manifest.save_id, info)
            self._done.add((step, manifest.save_id))
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

    def _owner(self, name: str) -> int:
        m = _RANK_FILE.match(name)
        return int(m.group(1)) % self.comm.world_size if m else 0

    def _decide(self, step: int) -> tuple[str, str]:
        try:
            manifest = self.local.read_manifest(step)
        except CheckpointError:
            return ("skip", "it is no longer committed locally")
        if self._durable.get(step, ("",))[0] == manifest.save_id:
            return ("done", "it is durable already")
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
        with self._hold_local():
            manifest = self._choose(restorer, step)
            if manifest is not None:
                restorer.load(manifest, state)
                self.observe(manifest.step)
        return manifest

    @contextlib.contextmanager
    def _hold_local(self) -> Iterator[None]:
        with self._no_prune:
            yield

    def _choose(self, restorer: Restorer, step: int | None) -> Manifest | None:
        comm = restorer.comm
        local: Manifest | None = None
        missing: CheckpointError | None = None
        try:
            local = restorer.choose(step)
        except CheckpointError as e:
            if step is None:
                raise
            missing = e
        steps = comm.broadcast(self.durable.committed_steps() if comm.is_coordinator else [])
        if step is not None:
            candidates = [step] if local is None and step in steps else []
        else:
            candidates = [s for s in reversed(steps) if local is None or s > local.step]
        for s in candidates:
            problem = self._fetch(comm, s)
            if problem is None:
                return restorer.choose(s)
            if comm.is_coordinator:
                msg = f"safepoint: durable checkpoint step {s} is unusable ({problem}); trying an older one"
                warnings.warn(msg, CheckpointWarning, stacklevel=4)
                log.warning(msg)
        if missing is not None:
            raise missing
        return local

    def _fetch(self, comm: Comm, step: int) -> str | None:
        """Download a durable checkpoint into the local tier; None if it worked, else what went wrong.

        Collective: every rank downloads a share of the files (into the shared local root, like a save),
        checking each file's crc32c as its bytes arrive; rank 0 commits it locally once all are in.
        """
        plan: tuple[bytes, str] | str = ""
        if comm.is_coordinator:
            try:
                raw = self.durable.manifest_bytes(step)
                manifest = Manifest.from_json(raw, step_hint=step)
                pending = self.local.new_pending(step, manifest.save_id)
                pending.mkdir(parents=True)
                plan = (raw, str(pending))
            except (CheckpointError, OSError) as e:
                plan = str(e)
        plan = comm.broadcast(plan)
        if isinstance(plan, str):
            return plan
        manifest, pending = Manifest.from_json(plan[0], step_hint=step), Path(plan[1])

        def get(name: str) -> None:
            entry = manifest.files[name]
            key = self.durable.object_key(step, name)
            crc = self.durable.store.download(key, str(pending / name), entry.size)
            if crc != entry.crc32c:
                raise CorruptCheckpointError(step, name, f"crc32c {crc} != {entry.crc32c} (contents altered)")

        t0, problem = time.perf_counter(), None
        try:
            self.durable.store._parallel(get, sorted(manifest.files)[comm.rank :: comm.world_size])
        except (CheckpointError, OSError) as e:
            problem = str(e)
        problems = [p for p in comm.all_gather(problem) if p]
        if comm.is_coordinator:
            if not problems:
                try:
                    self.local.commit(pending, manifest)
                except (CheckpointError, OSError) as e:
                    problems.append(f"local commit: {e}")
            if problems:
                self.local.discard(pending)
        problems = comm.broadcast(problems)
        if problems:
            return problems[0]
        with self._cv:
            self._durable[step] = (manifest.save_id, self.durable.info(step, manifest))
            self._done.add((step, manifest.save_id))
        log.info(
            "safepoint: downloaded durable step %d (%.1f MB in %.2fs)",
            step,
            manifest.total_bytes / 1e6,
            time.perf_counter() - t0,
        )
        return None

    def list(self) -> list[CheckpointInfo]:
        """Both tiers, oldest first; a step present locally is listed with its local path."""
        local = {i.step: i for i in infos(self.local)}
        durable = {i.step: i for i in infos(self.durable)}
        return [local.get(s) or durable[s] for s in sorted(local.keys() | durable.keys())]

    def lag(self) -> DurabilityLag:
        with self._cv:
            infos = [info for _, info in self._durable.values()]
            pending = len(self._queue) + (self._busy is not None)
        return self._lag(max(infos, key=lambda i: i.step) if infos else None, pending)
