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
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from safepoint.dist import Comm
from safepoint.errors import CheckpointError
from safepoint.remote.layout import RemoteLayout
from safepoint.store.layout import Layout
from safepoint.store.manifest import Manifest

log = logging.getLogger("safepoint")

_SHOWN = 10  # entries of a root named in an error


def _entries(root: Layout | RemoteLayout) -> list[str] | None:
    """What ``root`` holds (names, sorted), or None if it does not exist."""
    if isinstance(root, Layout):
        try:
            return sorted(os.listdir(root.root))
        except FileNotFoundError:
            return None
    return sorted(root.store.sizes(root.base)) or None  # a prefix with no object does not exist


class Resume:
    """One manager's ``resume`` mode and the root it resumes from (the durable one, with tiering: a new
    node's local disk is always empty)."""

    def __init__(self, mode: str, root: Layout | RemoteLayout) -> None:
        self.mode, self.root = mode, root
        self.created = False  # this manager created the root (rank 0 knows)

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

    def restore(self, comm: Comm, step: int | None, load: Callable[[], Manifest | None]) -> Manifest | None:
        """``load()`` (the tiers' restore, collective) as the mode says; None: start at step 0."""
        if self.mode == "never":
            if step is not None:
                raise ValueError(
                    f"restore(step={step}) loads a checkpoint, but this manager has resume='never'"
                )
            if comm.is_coordinator and (steps := self.root.committed_steps()):
                log.warning(
                    "safepoint: resume='never': starting at step 0; the %d checkpoints in %s (steps %d..%d) "
                    "are kept, not loaded; retention counts them with this run's, and a restart with "
                    "resume='auto' would load step %d",
                    len(steps), self.where, steps[0], steps[-1], steps[-1],
                )  # fmt: skip
            return None
        manifest = load()
        if manifest is None and self.mode == "required":
            why = comm.broadcast(self.describe() if comm.is_coordinator else None)
            raise CheckpointError(
                f"resume='required' but there is no checkpoint to resume in {self.where} ({why})"
            )
        return manifest

    def describe(self) -> str:
        """What the root holds, for the error of resume='required'."""
        try:
            entries = _entries(self.root)
        except OSError as e:
            return f"unreadable: {e}"
        if entries is None:
            return "it does not exist"
        own = {".pending", ".lease", ".attempts.json"}  # safepoint's own files, not checkpoints
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
