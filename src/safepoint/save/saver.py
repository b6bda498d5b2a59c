"""The synchronous save pipeline: capture -> write (+crc32c) -> commit -> retain."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
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
        save_id = self.comm.broadcast(uuid.uuid4().hex[:12] if self.comm.is_coordinator else "")
        pending = self.layout.new_pending(step, save_id)
        writer = self.layout.make_writer(pending, thread_count=self.writer_threads)
        if self.wrap_writer is not None:
            writer = self.wrap_writer(writer)
        error: str | None = None
        try:
            dcp_save(
                state_dict,
                storage_writer=writer,
                planner=self._planner(),
                process_group=self.comm.group,
                no_dist=not self.comm.distributed,
            )
        except (CheckpointException, OSError, RuntimeError, ValueError) as e:
            error = describe_exception(e)
        try:
            gathered = self.comm.all_gather((writer.written_files(), error))
        except PeerTimeoutError as e:
            if error is None:
                raise
            # DCP's own collective usually timed out first (same group); its message names the cause.
            raise PeerTimeoutError(f"{e} This rank's write had already failed: {error}") from e
        errors = [err for _, err in gathered if err]
        info: CheckpointInfo | None = None
        if self.comm.is_coordinator:
            if not errors:
                try:
                    info = self._commit(
                        step,
                        pending,
                        save_id,
                        [f for f, _ in gathered],
                        sections,
                        metrics,
                        manifest_extra or {},
                        dict(timings, write_s=time.perf_counter() - t0),
                    )
                except (OSError, CheckpointError) as e:
                    errors.append(describe_exception(e))
            if errors:
                self.layout.discard(pending)
        outcome = self.comm.broadcast((info, errors))
        info, errors = outcome
        if errors or info is None:
            raise SaveError(
                f"save of step {step} failed and was not committed ({'; '.join(dict.fromkeys(errors))}). "
                "Older checkpoints are intact."
            )
        if self.comm.is_coordinator:
            self.verdicts.forget(step)  # its bytes are new: whatever was found about the old ones is moot
            self._retain(step)
        return info

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

    def _retain(self, committed: int) -> None:
        """Apply the policies; the step just committed and the newest step verified intact survive."""
        try:
            history = []
            for s in self.layout.committed_steps():
                if self.verdicts.corrupt(s):
                    continue  # never counted as the newest, as kept or as deleted
                try:
                    history.append(self.layout.info(s, self.layout.read_manifest(s)))
                except CheckpointError:
                    continue  # unreadable manifests are never counted as kept or deleted
            good = self.verdicts.newest_intact([c.step for c in history])
            protect = {committed} | ({good} if good is not None else set())
            for step in self.retention.to_delete(history, protect):
                self.layout.remove(step)
                log.info("safepoint: retention removed step %d", step)
        except (OSError, CheckpointError) as e:  # CheckpointError: LeaseError from the fence
            # The new checkpoint is committed; a failed cleanup costs space, not correctness.
            log.warning("safepoint: retention pass failed (%s); will retry after the next save", e)
