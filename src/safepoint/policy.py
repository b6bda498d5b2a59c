"""retain and schedule: small policy objects, pure functions of the checkpoint history."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from safepoint.layout import CheckpointInfo

# ---- when to save ------------------------------------------------------------------------------------


class SavePolicy(Protocol):
    def due(self, step: int, now: float, last_step: int | None, last_time: float) -> bool: ...


@dataclasses.dataclass(frozen=True, slots=True)
class EveryNSteps:
    """Due when ``step`` is a multiple of ``n`` (deterministic, so ranks agree without talking)."""

    n: int

    def __post_init__(self) -> None:
        _positive("save_every_steps", self.n)

    def due(self, step: int, now: float, last_step: int | None, last_time: float) -> bool:
        return step % self.n == 0


@dataclasses.dataclass(frozen=True, slots=True)
class EveryNSeconds:
    """Due when ``seconds`` have passed since the last save (or since the manager started)."""

    seconds: float

    def __post_init__(self) -> None:
        _positive("save_every_seconds", self.seconds)

    def due(self, step: int, now: float, last_step: int | None, last_time: float) -> bool:
        return now - last_time >= self.seconds


# ---- what to keep ------------------------------------------------------------------------------------


class RetentionPolicy(Protocol):
    def keep(self, history: Sequence[CheckpointInfo]) -> set[int]: ...


@dataclasses.dataclass(frozen=True, slots=True)
class KeepLast:
    n: int

    def __post_init__(self) -> None:
        _positive("keep_last", self.n)

    def keep(self, history: Sequence[CheckpointInfo]) -> set[int]:
        return {c.step for c in sorted(history, key=lambda c: c.step)[-self.n :]}


@dataclasses.dataclass(frozen=True, slots=True)
class KeepEvery:
    """Milestones: keep every checkpoint whose step is a multiple of ``steps``."""

    steps: int

    def __post_init__(self) -> None:
        _positive("keep_every_steps", self.steps)

    def keep(self, history: Sequence[CheckpointInfo]) -> set[int]:
        return {c.step for c in history if c.step % self.steps == 0}


@dataclasses.dataclass(frozen=True, slots=True)
class KeepBest:
    """The ``n`` best checkpoints by ``metric`` (ties go to the newer).

    Checkpoints without the metric do not compete."""

    n: int
    metric: str
    mode: str = "min"

    def __post_init__(self) -> None:
        _positive("keep_best", self.n)
        if self.mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.mode!r}")

    def keep(self, history: Sequence[CheckpointInfo]) -> set[int]:
        scored = [c for c in history if self.metric in c.metrics]
        sign = 1.0 if self.mode == "min" else -1.0
        scored.sort(key=lambda c: (sign * c.metrics[self.metric], -c.step))
        return {c.step for c in scored[: self.n]}


@dataclasses.dataclass(frozen=True, slots=True)
class Retention:
    """Union of policies. No policy keeps everything. The newest checkpoint is never deleted."""

    policies: tuple[RetentionPolicy, ...] = ()

    def to_delete(self, history: Sequence[CheckpointInfo]) -> list[int]:
        if not self.policies or not history:
            return []
        keep: set[int] = {max(c.step for c in history)}
        for p in self.policies:
            keep |= p.keep(history)
        return sorted(c.step for c in history if c.step not in keep)


def build_retention(
    keep_last: int | None,
    keep_every_steps: int | None,
    keep_best: int | None,
    best_metric: str | None,
    best_mode: str,
) -> Retention:
    policies: list[RetentionPolicy] = []
    if keep_last is not None:
        policies.append(KeepLast(keep_last))
    if keep_every_steps is not None:
        policies.append(KeepEvery(keep_every_steps))
    if keep_best is not None:
        if not best_metric:
            raise ValueError("keep_best needs best_metric (the name of a metric passed to save/maybe_save)")
        policies.append(KeepBest(keep_best, best_metric, best_mode))
    elif best_metric is not None:
        raise ValueError("best_metric is set but keep_best is not; set keep_best=N to keep the N best")
    if best_mode not in ("min", "max"):
        raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
    return Retention(tuple(policies))


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
