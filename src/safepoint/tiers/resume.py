"""``CheckpointManager(resume=...)``: what ``restore()`` does with the checkpoints ROOT holds, or lacks.

- "auto" (default): the newest intact checkpoint if there is one, else step 0.
- "required": a job that must continue (a restart, a fine-tune of a given run) fails if there is nothing to
  continue from, naming the root and what it holds: a typo'd root otherwise trains from scratch in silence.
- "never": step 0 whatever the root holds. The checkpoints there are neither loaded nor deleted; they stay
  committed, so retention counts them with this run's (see docs/concepts.md: a fresh run belongs in a new
  root).

It is the manager's argument, not restore()'s: it is decided once per job (every launch of a job runs the
same line), it is checked with the other arguments before a process group exists, and the root's creation
(warned about at the manager's start) is part of the same question.

``init_from=`` (a warm start) is the manager's for the same reasons: it applies only when the job's own root
has no checkpoint (so a restarted fine-tune resumes its own progress, never the starting point again: what
torchtitan's ``initial_load_path`` and Composer's ``load_path`` do), and ``restore()`` stays the one
idempotent call every launch makes. The source is only read: no lease is taken and nothing is written.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from safepoint import events as ev
from safepoint.dist import Comm
from safepoint.errors import CheckpointError
from safepoint.options import WarmStart
from safepoint.remote.object_layout import RemoteLayout, is_url
from safepoint.restore.partial import RestoreReport, Selection
from safepoint.restore.restorer import Restorer
from safepoint.state import TrainState
from safepoint.store.guard import parse_step
from safepoint.store.manifest import MANIFEST_NAME, Manifest
from safepoint.store.posix_layout import Layout
from safepoint.store.rootfs import RootDir
from safepoint.tiers.base import SingleTier

log = logging.getLogger("safepoint")

_SHOWN = 10  # entries of a root named in an error


def _entries(root: Layout | RemoteLayout) -> list[str] | None:
    """What ``root`` holds (names, sorted), or None if it does not exist."""
    if isinstance(root, Layout):
        return root.fs.listdir("") if root.fs.lexists("") else None
    return sorted(root.store.sizes(root.base)) or None  # a prefix with no object does not exist


class Resume:
    """One manager's ``resume`` mode and the root it resumes from (the durable one, with tiering: a new
    node's local disk is always empty)."""

    events: ev.Events = ev.NO_EVENTS  # the manager's stream (events.py): restore_begin, restore

    def __init__(
        self,
        mode: str,
        root: Layout | RemoteLayout,
        init_from: WarmStart | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.mode, self.root = mode, root
        self.init_from, self.storage_options = init_from, storage_options
        self.created = False  # this manager created the root (rank 0 knows)
        self.report: RestoreReport | None = None
        """What the warm start of the last restore() loaded (None: none happened)."""

    @property
    def where(self) -> str:
        return str(self.root.root) if isinstance(self.root, RemoteLayout) else os.path.abspath(self.root.root)

    def before_create(self, comm: Comm) -> None:
        """At the manager's start, before rank 0 creates the root: a root that does not exist yet is
        worth a warning (a typo starts a run from scratch)."""
        if not comm.is_coordinator:
            return
        try:
            self.created = _entries(self.root) is None
        except OSError:
            return  # the root's own checks say what is wrong with it
        if self.created:
            log.warning(
                "safepoint: creating a new checkpoint root %s: a fresh run, nothing to resume", self.where
            )

    def restore(
        self,
        comm: Comm,
        step: int | None,
        state: TrainState,
        tiers: SingleTier,
        restorer: Restorer,
        selection: Selection,
    ) -> tuple[Manifest | None, RestoreReport | None]:
        """The tiers' restore with ``restorer`` (collective) as the mode says, loading what ``selection``
        selects; no manifest: start at step 0 (after the warm start from ``init_from``, if
        one is configured). The report says what was loaded and what was left."""
        self.report = None
        restorer.selection, restorer.last_report = selection, None
        self.events.emit(ev.RESTORE_BEGIN, step)
        t0 = time.perf_counter()
        manifest = self._own(comm, step, lambda: tiers.restore(restorer, state, step))
        where = str(self.root.step_path(manifest.step)) if manifest is not None else None
        took = time.perf_counter() - t0
        self.events.emit(ev.RESTORE, manifest.step if manifest else 0, duration_secs=took, directory=where)
        if manifest is None:
            if self.init_from is not None and step is None:
                self.warm_start(comm, state, self.init_from)
            return None, self.report
        report = restorer.last_report
        if report is not None and not report.complete and comm.is_coordinator:
            log.warning("safepoint: restore of step %d: %s", manifest.step, report.describe())
        return manifest, report

    def _own(self, comm: Comm, step: int | None, load: Callable[[], Manifest | None]) -> Manifest | None:
        if self.mode == "never":
            if step is not None:
                raise ValueError(
                    f"restore(step={step}) loads a checkpoint, but this manager has resume='never'"
                )
            if comm.is_coordinator and (steps := self.root.committed_steps()):
                held = f"the {len(steps)} checkpoints in {self.where} (steps {steps[0]}..{steps[-1]}) are"
                if len(steps) == 1:
                    held = f"the checkpoint in {self.where} (step {steps[0]}) is"
                log.warning(
                    "safepoint: resume='never': starting at step 0; %s kept, not loaded; retention counts "
                    "them with this run's, and a restart with resume='auto' would load step %d",
                    held, steps[-1],
                )  # fmt: skip
            return None
        manifest = load()
        if manifest is None and self.mode == "required":
            why = comm.broadcast(self.describe() if comm.is_coordinator else None)
            raise CheckpointError(
                f"resume='required' but there is no checkpoint to resume in {self.where} ({why})"
            )
        return manifest

    def warm_start(self, comm: Comm, state: TrainState, spec: WarmStart) -> None:
        """Load ``spec``'s checkpoint into ``state`` (collective); the run still starts at step 0."""
        layout, step, where = _open_source_everywhere(comm, spec, self.storage_options)
        restorer = Restorer(layout, comm)  # its own verdicts: retention of this root never sees them
        restorer.selection = Selection(strict=spec.strict, ignore=spec.ignore, remap=spec.remap)
        manifest = restorer.restore(state, step, lambda below: restorer.choose(step, below))
        if manifest is None or restorer.last_report is None:
            raise CheckpointError(f"init_from={where!r}: no intact checkpoint there to start from")
        self.report = dataclasses.replace(restorer.last_report, source=where, warm_start=True)
        if comm.is_coordinator:
            log.warning(
                "safepoint: no checkpoint in %s: warm start from %s step %d (%s); training starts at step 0",
                self.where, where, manifest.step, self.report.describe(),
            )  # fmt: skip

    def describe(self) -> str:
        """What the root holds, for the error of resume='required'."""
        try:
            entries = _entries(self.root)
        except OSError as e:
            return f"unreadable: {e}"
        if entries is None:
            return "it does not exist"
        own = {".pending", ".lease", ".attempts.json", ".journal.jsonl", ".progress"}  # safepoint's own files
        others = [e for e in entries if e not in own]
        if not others:
            return "empty, created just now" if self.created else "empty"
        steps = self.root.committed_steps()
        shown = ", ".join(others[:_SHOWN]) + (
            f", ... ({len(others)} entries)" if len(others) > _SHOWN else ""
        )
        if steps:  # committed but none restorable: each was reported above (corrupt, unreadable)
            return f"no intact checkpoint among steps {steps}; it holds: {shown}"
        return f"no checkpoint (a step-N directory with a manifest); it holds: {shown}"


def _open_source_everywhere(
    comm: Comm, spec: WarmStart, storage_options: dict[str, Any] | None
) -> tuple[Any, int | None, str]:
    """:func:`_open_source` on every rank, which all fail alike if any cannot (collective): a node-local
    path that exists on some nodes only must not leave the others waiting in ``choose``'s broadcast."""
    try:
        opened, why = _open_source(spec, storage_options), None
    except CheckpointError as e:
        opened, why = None, str(e)
    failed = [(r, w) for r, w in enumerate(comm.all_gather(why)) if w is not None]
    if len(failed) == comm.world_size:
        raise CheckpointError(failed[0][1])
    if failed:
        ranks = ", ".join(str(r) for r, _ in failed)
        raise CheckpointError(
            f"rank {ranks}: {failed[0][1]}, but the other ranks can read it (a path local to some nodes?): "
            "every rank reads the warm start; use a path every node can read, or copy it to each node"
        )
    assert opened is not None
    return opened


def _open_source(spec: WarmStart, storage_options: dict[str, Any] | None) -> tuple[Any, int | None, str]:
    """(a read-only layout, the step to load or None for the newest, the source as shown)."""
    path = os.fspath(spec.path).rstrip("/")
    parent, _, name = path.rpartition("/")
    step = parse_step(name)
    if is_url(path) and not path.startswith("file://"):
        if step is not None and parent:
            return RemoteLayout(parent, storage_options), step, path
        return RemoteLayout(path, storage_options), spec.step, path
    local = path.removeprefix("file://")
    if step is not None and RootDir(local).isfile(MANIFEST_NAME):
        return Layout(os.path.dirname(os.path.abspath(local))), step, local
    if not RootDir(local).isdir(""):
        raise CheckpointError(f"init_from={local!r} does not exist (a checkpoint root or a step-N directory)")
    return Layout(local), spec.step, local
