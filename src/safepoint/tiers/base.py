"""tiers: where saves commit and what is durable. One tier here; two (local + durable) in tiering.py.

``plan_tiers`` turns the manager's ``root`` / ``local_root`` into the layout saves commit to and, with
``local_root``, the durable tier. ``SingleTier`` is what the manager talks to when there is one tier (the
tier saves commit to is the durable one); ``tiering.Tiering`` has the same methods with an uploader.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from safepoint import events as ev
from safepoint.dist import Comm
from safepoint.errors import CheckpointError, LeaseError, warn_caller
from safepoint.policy.emergency_plan import EmergencyPlan
from safepoint.policy.history import TierEstimate, save_estimate
from safepoint.remote.object_layout import RemoteLayout, is_url
from safepoint.remote.retry import TransferOptions
from safepoint.restore.restorer import Restorer
from safepoint.state import TrainState
from safepoint.store.heartbeat import HeldByThisJob
from safepoint.store.manifest import Manifest
from safepoint.store.posix_layout import CheckpointInfo, CheckpointStore, Layout, step_name

log = logging.getLogger("safepoint")


@dataclasses.dataclass(frozen=True, slots=True)
class DurabilityLag:
    """How much training the durable tier does not hold yet (what losing this node would cost)."""

    steps: int
    """Steps seen by the manager since the newest durable checkpoint (all of them if there is none)."""
    seconds: float
    """Seconds since the newest durable checkpoint's state was captured (or since the manager started)."""
    durable_step: int | None
    """The newest durable checkpoint's step."""
    uploads_pending: int = 0
    """Checkpoints committed locally and waiting for (or in) upload."""


def plan_tiers(
    root: str | os.PathLike[str],
    local_root: str | os.PathLike[str] | None,
    storage_options: dict[str, Any] | None,
    transfer: TransferOptions,
) -> tuple[str, Layout | RemoteLayout, RemoteLayout | None]:
    """(root as shown, the layout saves commit to, the durable tier or None when there is one tier)."""
    if not isinstance(root, (str, os.PathLike)) or not str(root):
        raise ValueError(f"root must be a non-empty path or URL, got {root!r}")
    s = os.fspath(root)
    if local_root is None:
        if is_url(s) and not s.startswith("file://"):
            remote = RemoteLayout(s, storage_options, transfer=transfer)
            return remote.root, remote, None
        if storage_options:
            raise ValueError("storage_options apply to URL roots (s3://...) only")
        path = s[len("file://") :] if s.startswith("file://") else s
        return path, Layout(path), None
    local = os.fspath(local_root)
    if is_url(local) and not local.startswith("file://"):
        raise ValueError(f"local_root must be a local path, got {local!r}")
    local = local.removeprefix("file://")
    # Uploads are background work: their threads yield the CPU to training (TransferOptions.background).
    bg = dataclasses.replace(transfer, background=True)
    durable = RemoteLayout(s if is_url(s) else "file://" + os.path.abspath(s), storage_options, transfer=bg)
    if durable.root.rstrip("/") in ("file://" + os.path.abspath(local), "file://" + os.path.realpath(local)):
        raise ValueError("root and local_root are the same directory; local_root is for a faster local disk")
    return local, Layout(local), durable


class SingleTier:
    """One tier (a local root, or a URL root written directly): the tier saves commit to is durable."""

    events: ev.Events = ev.NO_EVENTS  # the manager's stream (events.py): durable, deleted

    def __init__(self, layout: CheckpointStore) -> None:
        self.layout = layout
        self._seen = 0
        self._started = time.time()

    def take_ownership(self, stale_after_s: float, job: str | None = None) -> list[str]:
        return []

    def start(self) -> None:
        pass

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Background uploads hold off inside this block (a save the training loop is waiting for)."""
        yield

    def observe(self, step: int) -> None:
        self._seen = max(self._seen, step)

    def committed(self, info: CheckpointInfo, *, upload: bool = True) -> CheckpointInfo:
        """A save committed ``info`` (called on every rank, in the same order); returns it. ``upload``:
        False for an emergency save whose upload does not fit in the grace (tiering only)."""
        self.observe(info.step)
        self.events.emit(ev.SAVE_DURABLE, info.step, tier="root", directory=str(info.path), lag_secs=0.0)
        return info

    def estimates(self) -> list[TierEstimate]:
        """What an emergency save would cost per tier, fastest first, from the recorded history."""
        return [save_estimate("root", self.layout)]

    def preempted(self, plan: EmergencyPlan | None, deadline: float | None) -> None:
        """The emergency save is done, skipped, or not needed (``plan`` None: the step was committed
        already), and the process exits by ``deadline`` (time.monotonic(); None: no grace_seconds)."""

    def raise_failure(self) -> None:
        pass

    def wait(self) -> None:
        pass

    def close(self, *, raise_failure: bool = True, before_release: Callable[[], None] | None = None) -> None:
        if before_release is not None:  # one tier: the root's lease is the manager's, released after this
            before_release()

    def restore(self, restorer: Restorer, state: TrainState, step: int | None) -> Manifest | None:
        manifest = restorer.restore_newest(state, step)
        if manifest is not None:
            self.observe(manifest.step)
        return manifest

    def list(self) -> list[CheckpointInfo]:
        return infos(self.layout)

    def lag(self) -> DurabilityLag:
        infos = self.list()
        return self._lag(infos[-1] if infos else None, 0)

    def _lag(self, newest: CheckpointInfo | None, pending: int) -> DurabilityLag:
        now = time.time()
        if newest is None:
            return DurabilityLag(self._seen, now - self._started, None, pending)
        return DurabilityLag(
            max(0, self._seen - newest.step), max(0.0, now - newest.time), newest.step, pending
        )


def infos(layout: CheckpointStore) -> list[CheckpointInfo]:
    out = []
    for s in layout.committed_steps():
        try:
            out.append(layout.info(s, layout.read_manifest(s)))
        except CheckpointError as e:
            log.warning("safepoint: not listing step %d of %s: %s", s, layout.root, e)
    return out


def read_durable(durable: RemoteLayout) -> dict[int, tuple[str, CheckpointInfo]]:
    """step -> (save_id, info) of the durable tier's committed checkpoints (unreadable ones skipped)."""
    out = {}
    for step in durable.committed_steps():
        try:
            m = durable.read_manifest(step)
        except CheckpointError as e:
            log.warning("safepoint: durable step %d is unreadable (%s); ignoring it", step, e)
            continue
        out[step] = (m.save_id, durable.info(step, m))
    return out


def drop_node_shares(local: Layout, durable: dict[int, tuple[str, CheckpointInfo]]) -> list[str]:
    """Rank 0 of a job on one node: remove local copies that hold one node's share of a durable checkpoint
    (saved while the job spanned several nodes, tiers/node_tiers.py). They cannot be loaded from this disk
    alone, and the durable tier has the whole checkpoint; a partial copy that is not durable is left to
    restore's verdict (corrupt)."""
    done = []
    for step in local.committed_steps():
        try:
            manifest = local.read_manifest(step)
        except CheckpointError:
            continue
        base = step_name(step)
        if durable.get(step, ("",))[0] == manifest.save_id and not all(
            local.fs.isfile(f"{base}/{name}") for name in manifest.files
        ):
            local.remove(step)
            done.append(f"removed local step {step}: one node's share of a durable checkpoint")
    return done


def prune_local(
    local: Layout,
    keep_local_last: int,
    waiting: Callable[[], set[int | None]],
    done: set[tuple[int, str]],
    events: ev.Events = ev.NO_EVENTS,
) -> None:
    """keep_local_last, removing only copies that need no upload (``done``) and are not ``waiting()``
    (the uploader's queue and the upload in flight, taken after listing the local steps)."""
    try:
        steps = local.committed_steps()
        in_flight = waiting()
        for step in steps[:-keep_local_last]:
            try:
                save_id = local.read_manifest(step).save_id
            except CheckpointError:
                continue
            if step not in in_flight and (step, save_id) in done:
                local.remove(step)
                events.emit(ev.SAVE_DELETED, step, tier="local")
                log.info(
                    "safepoint: removed local step %d (durable, keep_local_last=%d)", step, keep_local_last
                )
    except OSError as e:
        log.warning("safepoint: local retention pass failed (%s)", e)


# A root that cannot be written (read-only mount, full disk, no permission): restore still works.
_CANNOT_WRITE = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM})


def _cannot_write(e: BaseException | None) -> OSError | None:
    while e is not None:
        if isinstance(e, OSError) and e.errno in _CANNOT_WRITE:
            return e
        e = e.__cause__
    return None


def take_ownership(
    comm: Comm,
    layout: Layout | RemoteLayout,
    tiers: SingleTier,
    root: str,
    stale_after_s: float,
    job: str | None = None,
) -> tuple[Any, CheckpointError | None, str | None]:
    """Collective, at the manager's start: rank 0 takes the root for ``job`` (store/job.py: lease, cleanup
    of unfinished saves, the tiers' own step); returns (rank 0's lease or None, the error every rank then
    raises, or None; why the root can only be read, or None). An existing local root that cannot be
    written (read-only, full, no permission), or held by a live process of this same job on this host, is
    read without the lease, with a warning: restoring changes nothing, and saves refuse."""
    lease: Any = None
    error: CheckpointError | None = None
    read_only: str | None = None
    if comm.is_coordinator:
        try:
            layout.ensure_root()
            lease = layout.lease(stale_after_s, job)
            if lease is not None:
                lease.acquire()
            for line in [*layout.clean_pending(), *tiers.take_ownership(stale_after_s, job)]:
                log.info("safepoint: %s", line)
        except HeldByThisJob as e:
            # Another live process of this job holds the root (an evaluation beside the trainer): never
            # taken over, and nothing of it cleaned (its .pending may be a save in flight). Restore needs
            # no lease; saves refuse.
            if lease is not None:
                lease.release()
            lease, layout.owner = None, None
            read_only = str(e)
            msg = f"safepoint: {read_only}; restoring without the lease, and saves will fail"
            warn_caller(msg, ReadOnlyRootWarning)
            log.warning(msg)
        except (CheckpointError, OSError) as e:
            cause = _cannot_write(e)
            if cause is not None and isinstance(layout, Layout) and layout.fs.isdir(""):
                if lease is not None:
                    lease.release()
                lease, layout.owner = None, None
                read_only = f"cannot take the lease on {root} ({cause.strerror or cause})"
                msg = f"safepoint: {read_only}; restoring without it, and saves will fail"
                warn_caller(msg, ReadOnlyRootWarning)
                log.warning(msg)
            elif isinstance(e, CheckpointError):
                error = e
            else:
                error = CheckpointError(f"cannot use checkpoint root {root}: {e}")
    error, read_only = comm.broadcast((error, read_only))
    return lease, error, read_only


def check_owner(comm: Comm, lease: Any, read_only: str | None, step: int) -> None:
    """Before a save: LeaseError unless this manager may write the root. ``read_only`` is the same on every
    rank (take_ownership broadcast it). The lease lives on rank 0 only, so with peers it is not checked
    here: raised on rank 0 alone, the other ranks would wait in the save's collectives for a peer that never
    comes (a PeerTimeoutError), and a broadcast of its own would cost every save a collective. The commit
    fence (HeartbeatLease.fence) judges it instead, and the save's one broadcast (SyncSaver.write) carries
    its verdict to every rank: the same SaveError naming the lease everywhere. A single process checks at
    once and writes nothing."""
    if read_only is not None:
        raise LeaseError(f"not saving step {step}: {read_only} when this manager started")
    if not comm.distributed and lease is not None and lease.lost:
        raise LeaseError(f"not saving step {step}: {lease.lost}")


class ReadOnlyRootWarning(UserWarning):
    """The checkpoint root cannot be written: the manager restores without the lease; saves fail."""
