"""schedule: when ``maybe_save`` saves, and the record of the saves made (the adaptive interval's costs).

Step policies decide alone: every rank sees the same steps. Time policies depend on each rank's clock, so
ranks agree before acting on them (a save due on some ranks only would deadlock the save's collectives).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from safepoint.dist import Agreement, Comm
from safepoint.policy.history import RunHistory, adaptive_policy
from safepoint.policy.rules import (
    TIME_POLICIES,
    AdaptiveInterval,
    EveryNSeconds,
    EveryNSteps,
    SavePolicy,
    parse_interval,
)
from safepoint.store.posix_layout import Layout

log = logging.getLogger("safepoint")


@dataclasses.dataclass(slots=True)
class SaveRecord:
    """One save as the training loop saw it."""

    step: int
    blocking_s: float
    bytes: int


class SaveSchedule:
    """The manager's save policies, the ranks' agreement on time-based ones, and the saves made."""

    def __init__(
        self,
        save_every_steps: int | None,
        save_every_seconds: float | str | AdaptiveInterval | None,
        *,
        local: bool,
    ) -> None:
        """Validates the arguments (ValueError) and touches nothing else: the manager builds this before it
        creates its process groups, so a bad argument leaks none. :meth:`attach` adds the ranks' agreement."""
        self.policies: list[SavePolicy] = []
        if save_every_steps is not None:
            self.policies.append(EveryNSteps(save_every_steps))
        every_s, self.auto = parse_interval(save_every_seconds)
        if self.auto is not None and not local:
            raise ValueError(
                "save_every_seconds='auto' keeps its run history on a local disk: set local_root"
            )
        if every_s is not None:
            self.policies.append(EveryNSeconds(every_s))
        self.time_based = save_every_seconds is not None
        self._every_s = every_s
        self.agreement: Agreement | None = None
        self.last_step: int | None = None
        self.last_time = time.monotonic()
        self.saves: list[SaveRecord] = []

    def attach(self, comm: Comm) -> Agreement:
        """The ranks' agreement on time-based policies, on ``comm`` (the manager's group, once created)."""
        # Ranks compare their clocks about every 1% of the interval (at most once a second), not every step.
        target = min(1.0, (self.auto.min_s if self.auto else self._every_s or 0.0) / 100)
        self.agreement = Agreement(comm, target)
        return self.agreement

    def add_adaptive(self, layout: Layout, comm: Comm, runs: RunHistory | None) -> None:
        """With ``"auto"``: the adaptive policy (C from the saves recorded here, M from ``runs``)."""
        if self.auto is not None:
            costs = lambda: [s.blocking_s for s in self.saves]  # noqa: E731
            self.policies.append(adaptive_policy(self.auto, self.auto.mtbf_s, layout, comm, costs, runs))

    def due(self, step: int) -> bool:
        """Collective when a time policy is configured (every rank calls it at every maybe_save)."""
        if step == self.last_step or not self.policies:
            return False
        now = time.monotonic()
        if any(self._due(p, step, now) for p in self.policies if not isinstance(p, TIME_POLICIES)):
            return True
        if not self.time_based:
            return False
        timed = any(self._due(p, step, now) for p in self.policies if isinstance(p, TIME_POLICIES))
        assert self.agreement is not None, "SaveSchedule.attach() first"
        return self.agreement.agree(step, timed)

    def _due(self, policy: SavePolicy, step: int, now: float) -> bool:
        return policy.due(step, now, self.last_step, self.last_time)

    def saved(self, step: int, blocking_s: float, nbytes: int) -> None:
        self.saves.append(SaveRecord(step=step, blocking_s=blocking_s, bytes=nbytes))
        self.at(step)

    def at(self, step: int | None) -> None:
        """The state now is ``step``'s checkpoint (saved or restored); None: no step is known committed."""
        self.last_step = step
        if step is not None:
            self.last_time = time.monotonic()

    def say_committed(self, step: int, metrics: bool, coordinator: bool) -> None:
        """``save(step)`` for the step the state already is (:attr:`last_step`): the manager writes nothing
        (rewriting it would cost a whole save and drop the metrics ``maybe_save`` recorded); this says so."""
        if coordinator:
            log.warning(
                "safepoint: save(%d): step %d is already committed (saved or restored by this manager); not "
                "written again%s. Pass overwrite=True to replace it",
                step, step, ", and the metrics given here are not recorded" if metrics else "",
            )  # fmt: skip
