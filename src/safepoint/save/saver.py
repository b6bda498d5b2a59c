"""The synchronous save pipeline: capture -> write (+crc32c) -> commit; retention is queued for rank 0's
deleter thread (policy/retainer.py), so a save never waits on deletes."""

from __future__ import annotations

import logging
import os
import time
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from safepoint import events as ev
from safepoint.dist import Comm, PeerTimeoutError
from safepoint.errors import CheckpointError, SaveError, describe_exception
from safepoint.policy.retainer import Retainer
from safepoint.policy.rules import Retention, Verdicts
from safepoint.save.foreground import no_pause
from safepoint.save.one_process import save_one_process
from safepoint.save.plan_reuse import PlanRecord, ReusingSavePlanner
from safepoint.save.staging import Stager
from safepoint.store import rank_state
from safepoint.store.file_report import with_files
from safepoint.store.gc_pause import gc_paused
from safepoint.store.held_dirs import holding
from safepoint.store.incremental import INCREMENTAL_KEY, History
from safepoint.store.incremental_record import StoreWriterLike, read_previous
from safepoint.store.manifest import FileEntry, Manifest
from safepoint.store.metadata_bytes import MetadataPickle
from safepoint.store.node_map import NODES_KEY, NodeMap
from safepoint.store.posix_layout import CheckpointInfo, CheckpointStore, Layout
from safepoint.store.storage import SafepointWriter

log = logging.getLogger("safepoint")


class SyncSaver:
    events: ev.Events = ev.NO_EVENTS  # the manager's stream (events.py): written, committed, failed

    def __init__(
        self,
        layout: CheckpointStore,
        comm: Comm,
        retention: Retention | Retainer,
        writer_threads: int = 1,
        *,
        wrap_writer: Callable[[Any], Any] | None = None,
        history: History | None = None,
        staged: bool | Stager = False,
    ) -> None:
        self.layout = layout
        # A background saver's pause points (save/foreground.py; the manager sets its gate's): between its
        # phases and before each file it creates, it waits while the training thread writes a save beside
        # it. Each lies outside any lock.
        self.pause: Callable[[], None] = no_pause
        # Incremental saves (store/incremental.py): what this rank's last committed save wrote, shared with
        # the manager's other saver (sync and async saves link from whichever committed last). A local root
        # links unchanged files; an object store copies them server-side (remote/incremental_copy.py).
        self.history = history
        self.staged = staged
        """Saves staged copies (async): their version counters say nothing about the live tensors. The
        Stager itself: also what it proved of the copies (save/staging.py; one save in flight)."""
        # The manager shares one Retainer (one deleter thread, and what restore verified: retention keeps
        # the newest intact step) between its savers, and drains it on close(); a bare Retention gets one.
        if not isinstance(retention, Retainer):
            retention = Retainer(layout, retention, Verdicts())
        self.retainer, self.verdicts = retention, retention.verdicts
        self.comm = comm
        self.writer_threads = writer_threads
        # async_writer="process": the storage writer of each save, handed to the writer process.
        self.wrap_writer = wrap_writer
        # DCP's plan cache is class-level, under a key that defaults to the planner's class name: a key of
        # this saver's own keeps two managers in one process (two models, a benchmark) from overwriting
        # each other's cached plans on every save.
        self._plan_key = f"safepoint-{uuid.uuid4().hex}"
        # The cache is never emptied by DCP: a process that opens manager after manager (an evaluation
        # loop, a notebook) would keep every one's plans for good (the soak test saw RSS grow 28 KB per
        # manager for a 4-tensor model; a plan of 10,000 items is MBs). They go with this saver.
        weakref.finalize(self, _forget_plans, self._plan_key)
        self._plan_record = PlanRecord()  # the structure of the local plan cached under that key
        self._metadata_pickle = MetadataPickle()  # .metadata's head, pickled once per cached plan
        self._session: str | None = None
        self._saves = 0
        self.nodes: NodeMap | None = None
        """Set with per-node local tiers (tiers/node_tiers.py): each node's leader commits its own copy."""
        self._manifest: Manifest | None = None  # the last manifest rank 0 committed
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
        self.pause()
        t0 = time.perf_counter()
        self._manifest = None
        if self._leftovers:
            self._discard(*self._leftovers)
        save_id = self._next_save_id()
        pending = self.layout.new_pending(step, save_id)
        writer = self.layout.make_writer(pending, thread_count=self.writer_threads)
        if self.wrap_writer is not None:
            writer = self.wrap_writer(writer)
        if isinstance(writer, SafepointWriter):
            writer.pause_at(self.pause)
            writer.metadata_pickle = self._metadata_pickle
        round_ = None
        # Writers that arrange incremental saves: SafepointWriter (local), StoreWriter (object stores).
        if self.history is not None and isinstance(writer, SafepointWriter | StoreWriterLike):
            # A new process: the newest committed step's fingerprints, if they verify, so this first save
            # links (or copies) what did not change since (store/incremental_record.py).
            if self.history.fresh and (found := self._previous(writer)) is not None:
                self.history.seed(*found)
            round_ = writer.incremental = self.history.begin(versions=not self.staged)
            if isinstance(self.staged, Stager):
                round_.known = dict(self.staged.fingerprints)
        error: str | None = None
        own: dict[str, tuple[int, str]] = {}
        skipped = 0  # the checkpoint's bytes linked rather than written (every rank's; rank 0 sums them)
        try:
            # Per-rank sections go to this rank's own file, not into the global .metadata (rank_state.py);
            # the file's entry rides to rank 0 with DCP's file list.
            state_dict, sections_of_rank = rank_state.split_sections(state_dict)
            if sections_of_rank:
                own = _write_rank_file_too(writer, self.layout, pending, self.comm.rank, sections_of_rank)
            # DCP's write collective also carries each rank's file list to rank 0 (store/file_report.py),
            # and raises the same error on every rank when any rank failed.
            # DCP's per-item work without cyclic collections (store/gc_pause.py); the files it writes into
            # ``pending`` walked from the held directory, not from the root each (store/held_dirs.py).
            with gc_paused(), holding(*_own_dirs(self.layout, pending)):
                if self.comm.distributed:
                    dcp_save(
                        state_dict,
                        storage_writer=writer,
                        planner=self._planner(),
                        process_group=self.comm.group,
                    )
                else:  # one process: DCP's own steps, without its plumbing for many (save/one_process.py)
                    save_one_process(state_dict, writer, self._planner())
        except (CheckpointException, OSError, RuntimeError, ValueError) as e:
            error = describe_exception(e)
        else:
            linked = writer.linked_bytes() if isinstance(writer, SafepointWriter | StoreWriterLike) else 0
            mine = sum(size for size, _ in {**writer.written_files(), **own}.values()) - linked
            took = time.perf_counter() - t0
            self.events.emit(
                ev.SAVE_WRITTEN, step, bytes_written=mine, bytes_skipped=linked, duration_secs=took
            )
        errors = [error] if error else []
        info: CheckpointInfo | None = None
        self.pause()
        if self.comm.is_coordinator:
            if not errors:
                self.retainer.claim(step)  # no retention pass deletes this step number from now on
                try:
                    per_rank = list(writer.rank_files or [{}])
                    skipped = sum(getattr(writer, "rank_skipped", None) or [])
                    # With the .metadata finish wrote, and this rank's own file.
                    per_rank[self.comm.rank] = {**writer.written_files(), **own}
                    extra = dict(manifest_extra or {})
                    if round_ is not None:
                        # This rank's share: bytes linked from the previous step, written into stable groups.
                        extra[INCREMENTAL_KEY] = dict(round_.stats, full=round_.full)
                    info = self._commit(
                        step,
                        pending,
                        save_id,
                        per_rank,
                        sections,
                        metrics,
                        extra,
                        dict(timings, write_s=time.perf_counter() - t0),
                    )
                except (OSError, CheckpointError) as e:
                    errors.append(describe_exception(e))
            if errors:
                self._discard(pending)
            else:
                self.verdicts.forget(step)  # its bytes are new: what was found about the old ones is moot
            # Retention runs on the deleter thread, not here (None: nothing committed, the claim ends).
            self.retainer.committed(step, info, tuple(self._manifest.files) if self._manifest else None)
        # The one collective of our own: rank 0's verdict (committed, or why not) for every rank; with
        # per-node local tiers it carries the manifest to the other nodes' leaders.
        multi = self.nodes is not None and self.nodes.multi
        try:
            info, verdict, manifest, skipped = self.comm.broadcast(
                (info, errors, self._manifest if multi else None, skipped)
            )
        except PeerTimeoutError as e:
            self.events.emit(
                ev.SAVE_FAILED, step, reason=f"{e}" + (f" (this rank: {error})" if error else "")
            )
            if error is None:
                raise
            # DCP's own collective usually timed out first (same group); its message names the cause.
            raise PeerTimeoutError(f"{e} This rank's write had already failed: {error}") from e
        if info is not None and error is not None:
            # Rank 0 had every rank's files and committed: this rank failed after its part was done.
            log.warning("safepoint: step %d committed, though this rank reported: %s", step, error)
        errors = verdict or ([error] if error and info is None else [])
        if multi and self.nodes is not None and self.nodes.is_leader and not self.comm.is_coordinator:
            if manifest is not None and not errors:
                self._commit_node(pending, manifest)
            else:  # not committed: this node's share goes, as rank 0's did
                self.layout.discard(pending)
        if round_ is not None and self.history is not None and info is not None and not errors:
            # Where its files lie: a local step's directory, or a store's key prefix (step_key).
            where = getattr(self.layout, "step_key", self.layout.step_path)
            self.history.committed(round_, Path(where(step)))
        if errors or info is None:
            why = "; ".join(dict.fromkeys(errors))
            self.events.emit(ev.SAVE_FAILED, step, reason=why)
            raise SaveError.not_committed(step, why)
        # What this save wrote and what it linked from an older step: together, the checkpoint's size.
        done = {"bytes_written": info.bytes - skipped, "bytes_skipped": skipped}
        seconds = time.perf_counter() - t0
        self.events.emit(ev.SAVE_COMMITTED, step, duration_secs=seconds, directory=str(info.path), **done)
        if self.comm.is_coordinator:
            self.retainer.settle()  # inline mode: the pass runs now, after every rank has its verdict
        return info

    def _previous(self, writer: Any) -> Any:
        """The newest committed step's incremental record of this rank, verified, or None."""
        if isinstance(writer, StoreWriterLike):
            return writer.previous_record(self.layout, self.comm.rank)
        return read_previous(self.layout, self.comm.rank) if isinstance(self.layout, Layout) else None

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
        # the previous save instead of rebuilding them item by item (~0.1 ms per item), and the local plan
        # is not even built when its structure is provably unchanged (plan_reuse.py); a changed one is
        # planned afresh.
        return ReusingSavePlanner(self._plan_key, self._plan_record)

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
        # Every rank's files must be visible here, or the checkpoint could never be loaded as a whole
        # (with per-node local tiers: this node's ranks' files; the durable tier's commit checks the rest).
        nodes = self.nodes if self.nodes is not None and self.nodes.multi else None
        if self.comm.world_size == 1:
            # One rank: every file was written (and fsync'd) into ``pending`` by this rank's own writer,
            # which reports what it wrote; no other rank's files can be missing from view. The listing and
            # an lstat per file (~0.6 ms of a small save's ~14) prove nothing more; the loader still checks
            # every file's size and crc32c against the manifest.
            present = {name: size for name, (size, _) in per_rank[0].items()}
        else:
            present = self.layout.written_sizes(pending)
        here = {
            name
            for rank, rank_files in enumerate(per_rank)
            if nodes is None or nodes.same_node(rank, self.comm.rank)
            for name in rank_files
        }
        for name, entry in files.items():
            if name not in here:
                continue
            if name not in present:
                raise SaveError(
                    f"file {name} written by another rank is not visible from rank 0 at {pending}: the "
                    "checkpoint root looks node-local. Use a shared file system, or a URL root (object "
                    "storage) that every rank writes to, for a multi-node job. With local_root, the ranks "
                    "taken for one node (SAFEPOINT_NODE_ID, else host name and torchrun's GROUP_RANK) do "
                    "not share it: set SAFEPOINT_NODE_ID per disk (docs/elastic.md)."
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
            extra={
                **manifest_extra,
                "timings": {k: round(v, 6) for k, v in timings.items()},
                # Which ranks each node held: `safepoint verify` then tells a node's local copy (its own
                # ranks' files only) from a damaged checkpoint.
                **({NODES_KEY: nodes.ranges()} if nodes is not None else {}),
            },
        )
        self.layout.commit(pending, manifest)
        self._manifest = manifest
        log.info(
            "safepoint: committed step %d (%d files, %.1f MB)", step, len(files), manifest.total_bytes / 1e6
        )
        return self.layout.info(step, manifest)

    def _commit_node(self, pending: Any, manifest: Manifest) -> None:
        """A node leader other than rank 0 commits its node's local copy (its own ranks' files, under the
        job's manifest). A failure here is logged: the upload of this step then fails on this node's
        ranks, on every rank alike, and nothing is committed on the durable tier."""
        try:
            if not self.layout.written_sizes(pending):
                existing = self.layout.read_manifest(manifest.step)
                if existing.save_id == manifest.save_id:
                    return  # a local_root shared with rank 0's node: committed there already
            self.layout.commit(pending, manifest)
        except (OSError, CheckpointError) as e:
            log.error("safepoint: node-local commit of step %d failed: %s", manifest.step, e)


def _write_rank_file_too(
    writer: Any, layout: CheckpointStore, pending: Any, rank: int, sections: dict[str, Any]
) -> dict[str, tuple[int, str]]:
    """Make ``writer``'s write step also write this rank's rank file (once DCP made the directory, and
    inside DCP's collective, so a failure reaches every rank like any write error) and report it to rank
    0 with the other files (split_files merges every file report of a rank). Wraps the instance's
    write_data, whatever the writer's class (local, object store, the writer process's proxy). Returns
    the dict the file's entry lands in."""
    own: dict[str, tuple[int, str]] = {}
    inner = writer.write_data

    def write_data(plan: Any, planner: Any) -> Any:
        own.update(rank_state.write(layout, pending, rank, sections))
        return with_files(inner(plan, planner), own)

    writer.write_data = write_data
    return own


def _own_dirs(layout: CheckpointStore, pending: Any) -> tuple[Path, ...]:
    """What a local save holds open while it writes: its root, ``.pending`` and its own directory."""
    return (layout.root, layout.pending_root, pending) if isinstance(layout, Layout) else ()


def _forget_plans(key: str) -> None:
    """Drop what DCP's class-level plan cache holds under ``key`` (one saver's plans)."""
    for cache in (
        SavePlanner._cached_save_plan,
        SavePlanner._cached_final_save_plan,
        SavePlanner._cached_all_plans,
        SavePlanner._cached_global_plan,
        SavePlanner._cached_metadata,
    ):
        cache.pop(key, None)
