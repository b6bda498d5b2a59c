"""The emergency-save plan: full, fastest-tier or skip, from measured costs and the grace left.

A pure policy of the run history (``history.TierEstimate``): the tiers call it when a notice arrives, the
preemption flow acts on its answer. It lives here, below both, so neither imports the other for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from safepoint.policy.history import TierEstimate

__all__ = ["EmergencyPlan", "TierEstimate", "plan_emergency_save"]


@dataclasses.dataclass(frozen=True, slots=True)
class EmergencyPlan:
    """What the emergency save does: ``full`` (every tier), ``fastest-tier`` or ``skip``."""

    action: str
    tiers: tuple[str, ...]
    skipped: tuple[str, ...]
    expected_s: float | None
    remaining_s: float | None
    estimates: tuple[TierEstimate, ...] = ()

    @property
    def saves(self) -> bool:
        return bool(self.tiers)


def plan_emergency_save(tiers: Sequence[TierEstimate], remaining_s: float | None) -> EmergencyPlan:
    """The hook that decides full / fastest-tier / skip. Never start something that cannot finish.

    ``tiers`` are written in order, fastest first; a full save costs their sum. With no grace deadline
    (``remaining_s`` None) or no measured history the full save is attempted: refusing to save without
    evidence would lose work for sure. With one tier (the root) the choice is full or skip; with tiering
    (``local`` then ``durable``) a save that fits only locally is committed locally and not uploaded.
    """
    if not tiers:
        raise ValueError("no tier to save to")
    names, est = tuple(t.name for t in tiers), tuple(tiers)
    known = [t.expected_s for t in tiers]
    full_s = None if any(e is None for e in known) else sum(e for e in known if e is not None)
    if remaining_s is None or full_s is None or full_s <= remaining_s:
        return EmergencyPlan("full", names, (), full_s, remaining_s, est)
    fastest = tiers[0].expected_s
    if len(tiers) > 1 and fastest is not None and fastest <= remaining_s:
        return EmergencyPlan("fastest-tier", names[:1], names[1:], fastest, remaining_s, est)
    return EmergencyPlan("skip", (), names, full_s, remaining_s, est)
