"""emergency: what ``maybe_save`` does once every rank agreed on a preemption notice. The in-flight save
finishes, this step is saved synchronously if the plan says it fits in the grace, then ``Preempted`` is
raised with the step a restart resumes from."""

from __future__ import annotations

import logging
import time
from typing import Any, NoReturn, Protocol

from safepoint import events as ev
from safepoint.errors import LeaseError, SaveError
from safepoint.policy.history import RunHistory, outcome_of
from safepoint.policy.retainer import Retainer
from safepoint.policy.schedule import SaveSchedule
from safepoint.preempt.preemption import Preemption
from safepoint.remote.object_layout import RemoteLayout
from safepoint.save.background import BackgroundWriter
from safepoint.state import TrainState
from safepoint.store.manifest import clean_metrics
from safepoint.store.posix_layout import CheckpointInfo, Layout
from safepoint.tiers.base import SingleTier
from safepoint.tiers.tiering import Tiering

log = logging.getLogger("safepoint")


class SyncSave(Protocol):
    """The manager's synchronous save (``CheckpointManager._save_sync``); a LeaseError for a root the
    manager may not write (read-only, lease lost)."""

    def __call__(
        self,
        step: int,
        state: TrainState,
        metrics: dict[str, float],
        emergency: dict[str, str] | None = None,
        *,
        upload: bool = True,
    ) -> CheckpointInfo: ...


class EmergencySave:
    """The manager's parts the preemption flow needs; ``runs``: the restart history (adaptive interval)."""

    def __init__(
        self,
        preemption: Preemption,
        schedule: SaveSchedule,
        tiers: SingleTier,
        layout: Layout | RemoteLayout,
        writer: BackgroundWriter,
        retainer: Retainer,
        runs: RunHistory | None,
        save: SyncSave,
    ) -> None:
        self.preemption, self._schedule, self._tiers, self._layout = preemption, schedule, tiers, layout
        self._writer, self._retainer, self._runs, self._save = writer, retainer, runs, save
        self.events = tiers.events  # the manager's stream (events.py), wired into the tiers before this

    def run(self, step: int, state: TrainState, metrics: dict[str, Any] | None) -> NoReturn:
        """Every rank agreed on a notice: finish the save in flight, save this step synchronously, exit."""
        notice = self.preemption.notice  # this rank's (another rank's notice: none here)
        since = time.monotonic() - notice.at if notice.at is not None else None
        self.events.emit(
            ev.PREEMPTION, step, reason=notice.reason or "a notice on another rank", duration_secs=since
        )
        t_notice = time.perf_counter()
        # Old checkpoints can wait for the next owner: no delete competes with the emergency save for the
        # disk, and the exit (close) waits on one step's delete at most, not on every queued pass.
        self._retainer.abandon()
        self._writer.wait()
        try:
            self._writer.raise_failure()
        except SaveError as e:
            log.error("safepoint: the save in flight failed (%s); the emergency save replaces it", e)
            self._schedule.at(None)
        saved, plan = (step if step == self._schedule.last_step else None), None
        cause: SaveError | LeaseError | None = None
        if saved is None:
            plan = self.preemption.plan(self._tiers.estimates(), step)
            if plan.saves:
                try:
                    t0 = time.perf_counter()
                    emergency = {"reason": "; ".join(self.preemption.reasons), "plan": plan.action}
                    # A plan that skips the durable tier commits locally and never starts the upload.
                    upload = not plan.skipped
                    self._save(step, state, clean_metrics(metrics), emergency, upload=upload)
                    saved = step
                    log.warning(
                        "safepoint: emergency save of step %d took %.2fs", step, time.perf_counter() - t0
                    )
                except (SaveError, LeaseError) as e:  # LeaseError: a read-only root, or a lost lease
                    log.error("safepoint: emergency save of step %d failed: %s", step, e)
                    cause = e
        why = f"{plan.action}" if plan is not None else "this step was saved already"
        why, took = (why if cause is None else f"{why}; failed: {cause}"), time.perf_counter() - t_notice
        self.events.emit(ev.EMERGENCY_SAVE, saved, duration_secs=took, reason=why, emergency=True)
        self._tiers.preempted(plan, self.preemption.end_of_grace())
        exc = self.preemption.exit(step, saved, self._resume_step(saved), plan)
        if self._runs is not None:
            self._runs.end(outcome_of(exc))
        raise exc from cause

    def _resume_step(self, saved: int | None) -> int | None:
        """Where a restart resumes, from what this process knows, within the grace: no store request (not
        ``latest_step()``, which lists the durable tier and reads every manifest), and never an error."""
        steps = {s for s in (saved, self._schedule.last_step) if s is not None}
        try:
            if isinstance(self._tiers, Tiering):
                newest = self._tiers.resume_step()
                steps.update([newest] if newest is not None else [])
            elif isinstance(self._layout, Layout):  # a directory listing; a URL root: what this run knows
                steps.update(self._layout.committed_steps())
        except Exception as e:
            log.warning(
                "safepoint: cannot list the committed checkpoints (%s); resume step as far as known", e
            )
        return max(steps) if steps else None
