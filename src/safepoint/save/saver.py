"""The synchronous save pipeline: capture -> write (+crc32c) -> commit -> retain."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from safepoint.dist import Comm, PeerTimeoutError
from safepoint.errors import CheckpointError, SaveError, describe_exception
from safepoint.policy.rules import Retention, Verdicts
from safepoint.store.layout import CheckpointInfo, CheckpointStore
from safepoint.store.manifest import FileEntry, Manifest

log = logging.getLogger("safepoint")


class SyncSaver:
    def __init__(
        self,
        layout: CheckpointStore,
        comm: Comm,
        retention: Retention,
        *,
        writer_threads: int = 1,
        wrap_writer: Callable[[Any], Any] | None = None,
        verdicts: Verdicts | None = None,
    ) -> None:
        self.layout = layout
        # What restore verified (shared with the Restorer): retention keeps the newest intact step.
        self.verdicts = verdicts if verdicts is not None else Verdicts()
        self.comm = comm
        self.retention = retention
        self.writer_threads = writer_threads
        # async_writer="process": the storage writer of each save, handed to the writer process.
        self.wrap_writer = wrap_writer
        # DCP's plan cache is class-level, under a key that defaults to the planner's class name: a key of
        # this saver's own keeps two managers in one process (two models, a benchmark) from overwriting
        # each other's cached plans on every save.
        self._plan_key = f"safepoint-{uuid.uuid4().hex}"
        self._session: str | None = None
        self._saves = 0
        self._index: dict[int, CheckpointInfo] = {}  # retention's view of the root (see _retain)
        # Failed saves' directories that could not be deleted then (out of descriptors: deleting a tree
        # needs them too): the next save deletes them, rather than the next owner's start.
        self._leftovers: list[Path] = []

    def _next_save_id(self) -> str:
        """A hex id unique to this save: a session id agreed once (one broadcast, at the first save), then
        a counter every rank advances alike (saves are collective), so later saves need no collective."""
        if self._session is None:
            self._session = self.comm.broadcast(uuid.uuid4().hex[:8] if self.comm.is_coordinator else "")
        self._saves += 1
        return f"{self._session}{self._saves:04x}"

    def write(
        self,
        step: int,
        state_dict: dict[str, Any],
        sections: list[str],
        metrics: dict[str, float],
        timings: dict[str, float],
        manifest_extra: dict[str, Any] | None = None,
    ) -> CheckpointInfo:
        """Write a captured (or staged) state dict and commit it. Collective: every rank calls it."""
        t0 = time.perf_counter()
        if self._leftovers:
            self._discard(*self._leftovers)
        save_id = self._next_save_id()
        pending = self.layout.new_pending(step, save_id)
        writer = self.layout.make_writer(pending, thread_count=self.writer_threads)
        if self.wrap_writer is not None:
            writer = self.wrap_writer(writer)
        error: str | None = None
        try:
            # DCP's write collective also carries each rank's file list to rank 0 (store/file_report.py),
            # and raises the same error on every rank when any rank failed.
            dcp_save(
                state_dict,
                storage_writer=writer,
                planner=self._planner(),
                process_group=self.comm.group,
                no_dist=not self.comm.distributed,
            )
        except (CheckpointException, OSError, RuntimeError, ValueError) as e:
            error = describe_exception(e)
        errors = [error] if error else []
        info: CheckpointInfo | None = None
        if self.comm.is_coordinator:
            if not errors:
                try:
                    per_rank = list(writer.rank_files or [{}])
                    per_rank[self.comm.rank] = writer.written_files()  # with the .metadata finish wrote
                    info = self._commit(
                        step,
                        pending,
                        save_id,
                        per_rank,
                        sections,
                        metrics,
                        manifest_extra or {},
                        dict(timings, write_s=time.perf_counter() - t0),
                    )
                except (OSError, CheckpointError) as e:
                    errors.append(describe_exception(e))
            if errors:
                self._discard(pending)
        # The one collective of our own: rank 0's verdict (committed, or why not) for every rank.
        try:
            info, verdict = self.comm.broadcast((info, errors))
        except PeerTimeoutError as e:
            if error is None:
                raise
            # DCP's own collective usually timed out first (same group); its message names the cause.
            raise PeerTimeoutError(f"{e} This rank's write had already failed: {error}") from e
        if info is not None and error is not None:
            # Rank 0 had every rank's files and committed: this rank failed after its part was done.
            log.warning("safepoint: step %d committed, though this rank reported: %s", step, error)
        errors = verdict or ([error] if error and info is None else [])
        if errors or info is None:
            raise SaveError(
                f"save of step {step} failed and was not committed ({'; '.join(dict.fromkeys(errors))}). "
                "Older checkpoints are intact."
            )
        if self.comm.is_coordinator:
            self.verdicts.forget(step)  # its bytes are new: whatever was found about the old ones is moot
            self._retain(step, info)
        return info

    def _discard(self, *pendings: Any) -> None:
        """Delete failed saves' directories; a local one still there afterwards is retried next save.
        Only this saver's own failed saves: one save at a time per saver, none of them is in flight."""
        self._leftovers = []
        for pending in pendings:
            self.layout.discard(pending)
            if isinstance(pending, Path) and os.path.lexists(pending):
                log.warning(
                    "safepoint: could not delete %s (a failed save's files); the next save retries", pending
                )
                self._leftovers.append(pending)

    def _planner(self) -> DefaultSavePlanner:
        # With the same state (every save of a training run) DCP reuses the global plan and metadata of
        # the previous save instead of rebuilding them item by item (~0.1 ms per item); a changed local
        # plan is detected (compared item by item) and planned afresh.
        planner = DefaultSavePlanner(enable_plan_caching=True)
        planner._cached_plans_key = self._plan_key
        return planner

    def _commit(
        self,
        step: int,
        pending: Any,
        save_id: str,
        per_rank: list[dict[str, tuple[int, str]]],
        sections: list[str],
        metrics: dict[str, float],
        manifest_extra: dict[str, Any],
        timings: dict[str, float],
    ) -> CheckpointInfo:
        files: dict[str, FileEntry] = {}
        for rank, rank_files in enumerate(per_rank):
            for name, (size, crc) in rank_files.items():
                if name in files:
                    raise SaveError(
                        f"two ranks wrote the same file {name!r} (rank {rank}); refusing to commit"
                    )
                files[name] = FileEntry(size=size, crc32c=crc)
        # Every rank's files must be visible here, or the checkpoint could never be loaded as a whole.
        present = self.layout.written_sizes(pending)
        for name, entry in files.items():
            if name not in present:
                raise SaveError(
                    f"file {name} written by another rank is not visible from rank 0 at {pending}: the "
                    "checkpoint root (or local_root) looks node-local. Use a shared file system, or a URL "
                    "root (object storage) that every rank writes to, for a multi-node job."
                )
            if present[name] != entry.size:
                raise SaveError(f"file {name} has size {present[name]}, expected {entry.size}")
        manifest = Manifest(
            step=step,
            files=files,
            world_size=self.comm.world_size,
            metrics=metrics,
            keys=sections,
            save_id=save_id,
            extra={**manifest_extra, "timings": {k: round(v, 6) for k, v in timings.items()}},
        )
        self.layout.commit(pending, manifest)
        log.info(
            "safepoint: committed step %d (%d files, %.1f MB)", step, len(files), manifest.total_bytes / 1e6
        )
        return self.layout.info(step, manifest)

    def _retain(self, committed: int, info: CheckpointInfo) -> None:
        """Apply the policies; the step just committed and the newest step verified intact survive.

        From an index (``_index``: step -> (its manifest's save id, info)) kept across saves, so a save
        lists the root once and reads only manifests it has not seen (at most the new one's, which it
        wrote), instead of every manifest on every save. No policy: nothing to do, nothing read."""
        if not self.retention.policies:
            return
        try:
            self._index[committed] = info
            steps = self.layout.committed_steps()
            for s in list(self._index):
                if s not in steps:
                    del self._index[s]  # removed (by us, by prune, by hand)
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
            for step in self.retention.to_delete(history, protect):
                self.layout.remove(step)
                self._index.pop(step, None)
                log.info("safepoint: retention removed step %d", step)
        except (OSError, CheckpointError) as e:  # CheckpointError: LeaseError from the fence
            # The new checkpoint is committed; a failed cleanup costs space, not correctness.
            log.warning("safepoint: retention pass failed (%s); will retry after the next save", e)
