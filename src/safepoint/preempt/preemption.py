"""signals: the emergency save a preemption notice triggers, and the Preempted exit that follows.

A notice (a signal, a sentinel file, a user callable polled in the background) only sets a flag. Nothing
is saved from a signal handler: it interrupts the training thread at an arbitrary bytecode, possibly in the
middle of an optimizer step or while holding a lock the save needs (Lightning's intermittent failures came
from saving inside the handler). The flag is read at the next ``maybe_save``; ranks agree (one rank's notice
is enough), and the manager saves the current step synchronously and raises :class:`Preempted`.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from collections.abc import Sequence

from safepoint.dist import Agreement, Comm
from safepoint.errors import Preempted
from safepoint.options import DEFAULT_EXIT_CODE, PreemptionOptions
from safepoint.policy.emergency_plan import EmergencyPlan, TierEstimate, plan_emergency_save
from safepoint.preempt import shield
from safepoint.preempt.notices import FileNotice, Notice, NoticeSource, PollNotice, SignalNotice

log = logging.getLogger("safepoint")

__all__ = ["DEFAULT_EXIT_CODE", "Preempted", "Preemption", "TierEstimate", "plan_emergency_save"]

CHECK_EVERY_S = 0.25
"""Ranks compare their notice flags about this often (or every step, if steps are slower): one all_reduce
per check, ~0.4 ms on gloo here, so <0.2% of the time; the notice is acted on this much later at most
(while the step time holds; a k-fold slowdown stretches it k-fold until the next check re-measures)."""


class Preemption:
    """Notice sources, the cross-rank agreement and the emergency-save plan, for one manager."""

    def __init__(
        self,
        comm: Comm,
        sources: Sequence[NoticeSource],
        grace_seconds: float | None,
        exit_code: int,
        shield_workers: bool = True,
    ) -> None:
        self.comm = comm
        self.sources = list(sources)
        self.grace_seconds = grace_seconds
        self.exit_code = exit_code
        self.notice = Notice()
        self.shield_workers = shield_workers
        self._shield: frozenset[signal.Signals] | None = None
        # Checking on every maybe_save would cost one all_reduce per training step (~0.4 ms on gloo here);
        # ranks compare flags about every CHECK_EVERY_S instead, at steps they all agree on.
        self.agreement = Agreement(comm, CHECK_EVERY_S)
        self.reasons: list[str] = []
        self.deadline: float | None = None
        """time.monotonic() at which the grace ends (set by :meth:`plan`; None without grace_seconds)."""

    @classmethod
    def build(cls, comm: Comm, options: PreemptionOptions) -> Preemption | None:
        """None when no notice source is configured (the default: no handlers, no thread, no collective).

        Validates what depends on where it runs (the main-thread rule) but starts nothing: see :meth:`start`.
        ``options`` validated its own fields when it was built."""
        file, poll, grace_seconds = options.file, options.poll, options.grace_seconds
        sources: list[NoticeSource] = []
        if options.signals:
            sources.append(SignalNotice(options.signals))
        if file is not None:
            sources.append(FileNotice(file))
        if poll is not None:
            sources.append(PollNotice(poll, options.poll_interval_s))
        if not sources:
            if grace_seconds is not None:
                log.warning("safepoint: grace_seconds is set but no preemption notice source is configured")
            return None
        return cls(comm, sources, grace_seconds, options.exit_code, options.shield_workers)

    def start(self) -> None:
        """Install the handlers, start the poller."""
        started: list[NoticeSource] = []
        try:
            for s in self.sources:
                s.start(self.notice)
                started.append(s)
        except BaseException:
            for s in started:
                s.stop()
            raise
        signals = [sig for s in self.sources if isinstance(s, SignalNotice) for sig in s.signals]
        if signals and self.shield_workers:
            self._shield = shield.activate(signals)

    def agreed(self, step: int) -> bool:
        """Called by every rank at every maybe_save: True on all ranks once any rank has a notice."""
        for s in self.sources:
            s.check()
        return self.agreement.agree(step, self.notice.is_set)

    def plan(self, tiers: Sequence[TierEstimate], step: int) -> EmergencyPlan:
        """Collective (one all_gather): the same plan on every rank, from the earliest notice and, per tier,
        the slowest estimate among ranks. ``tiers``: this rank's estimates, fastest tier first (the
        manager's tiers object measures them from history: manifests, and uploads with tiering)."""
        now = time.monotonic()
        elapsed = now - self.notice.at if self.notice.at is not None else 0.0
        mine = [t.expected_s for t in tiers]
        gathered = self.comm.all_gather((elapsed, mine, self.notice.reason))
        elapsed = max(g[0] for g in gathered)
        worst = []
        for i, t in enumerate(tiers):
            known = [e for g in gathered if (e := g[1][i]) is not None]
            worst.append(dataclasses.replace(t, expected_s=max(known) if known else None))
        self.reasons = [
            f"{r}" if self.comm.world_size == 1 else f"{r} on rank {i}"
            for i, (_, _, r) in enumerate(gathered)
            if r
        ]
        remaining = None if self.grace_seconds is None else self.grace_seconds - elapsed
        # Counted from this rank's clock now: the earliest notice's elapsed time is already subtracted.
        self.deadline = None if remaining is None else now + remaining
        plan = plan_emergency_save(worst, remaining)
        grace = (
            f"{max(0.0, remaining):.1f}s of the {self.grace_seconds:g}s grace left"
            if remaining is not None
            else "no grace_seconds deadline"
        )
        log.warning(
            "safepoint: preemption notice (%s) acted on at step %d, %.2fs after it arrived; %s; "
            "expected save time %s: %s",
            "; ".join(self.reasons),
            step,
            elapsed,
            grace,
            ", ".join(_describe(t) for t in worst),
            plan.action,
        )
        return plan

    def end_of_grace(self) -> float | None:
        """When the grace ends (time.monotonic()): as planned, or, where no plan was needed (the step was
        committed already), from this rank's own notice, or from now if it learned of it from another."""
        if self.deadline is None and self.grace_seconds is not None:
            start = self.notice.at if self.notice.at is not None else time.monotonic()
            self.deadline = start + self.grace_seconds
        return self.deadline

    def exit(
        self, step: int, saved_step: int | None, resume_step: int | None, plan: EmergencyPlan | None
    ) -> Preempted:
        reason = "; ".join(self.reasons) or self.notice.reason or "a notice on another rank"
        if plan is not None and not plan.saves:
            fastest = plan.estimates[0] if plan.estimates else TierEstimate("root", plan.expected_s)
            log.error(
                "safepoint: NOT saving step %d: %s is expected to take %.2fs (%s) but only %.2fs of the %gs "
                "grace remain; skipped tier(s): %s. A restart resumes from the previous checkpoint "
                "(step %s), so steps %s-%d will be redone.",
                step,
                "the save" if len(plan.estimates) <= 1 else f"even the fastest tier ({fastest.name})",
                fastest.expected_s or 0.0,
                fastest.basis or "measured",
                max(0.0, plan.remaining_s or 0.0),
                self.grace_seconds or 0.0,
                ", ".join(plan.skipped),
                resume_step if resume_step is not None else "none: from scratch",
                (resume_step or 0) + 1,
                step,
            )
        elif plan is not None and plan.skipped and saved_step is None:
            log.error(
                "safepoint: emergency save of step %d (planned for %s only, skipping %s) failed: nothing was "
                "saved. A restart resumes from step %s.",
                step,
                ", ".join(plan.tiers),
                ", ".join(plan.skipped),
                resume_step if resume_step is not None else "none: from scratch",
            )
        elif plan is not None and plan.skipped:
            log.warning(
                "safepoint: emergency save of step %d wrote %s only; skipped %s: the full save is expected "
                "to take %s, more than the %.2fs of grace left",
                step,
                ", ".join(plan.tiers),
                ", ".join(plan.skipped),
                " + ".join(_describe(t) for t in plan.estimates),
                max(0.0, plan.remaining_s or 0.0),
            )
        exc = Preempted(
            self.exit_code, step=step, saved_step=saved_step, resume_step=resume_step, reason=reason
        )
        log.warning("safepoint: %s", exc)
        return exc

    def stop(self) -> None:
        if self._shield is not None:
            shield.deactivate(self._shield)
            self._shield = None
        for s in self.sources:
            s.stop()


def _describe(t: TierEstimate) -> str:
    if t.expected_s is None:
        return f"{t.name} unknown (nothing measured yet)"
    return f"{t.name} {t.expected_s:.2f}s" + (f" ({t.basis})" if t.basis else "")
