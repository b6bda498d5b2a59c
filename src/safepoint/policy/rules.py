"""retain and schedule: small policy objects, pure functions of the checkpoint history."""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from safepoint.store.posix_layout import CheckpointInfo

log = logging.getLogger("safepoint")

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


# ---- adaptive interval (save_every_seconds="auto") ---------------------------------------------------


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Optimum compute time between checkpoints: Daly's higher-order estimate.

    J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps", Future
    Generation Computer Systems 22 (2006): for C < 2M, T = sqrt(2CM) * [1 + sqrt(C/2M)/3 + (C/2M)/9] - C;
    otherwise T = M. C is the time a checkpoint stops the application, M the mean time between failures.
    Young's first-order sqrt(2CM) is the leading term; the correction matters once C is not tiny next to M.
    """
    if cost_s < 0 or not math.isfinite(cost_s):
        raise ValueError(f"checkpoint cost must be a finite non-negative number of seconds, got {cost_s!r}")
    if mtbf_s <= 0 or not math.isfinite(mtbf_s):
        raise ValueError(f"mtbf must be a finite positive number of seconds, got {mtbf_s!r}")
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    r = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - cost_s


@dataclasses.dataclass(frozen=True, slots=True)
class IntervalChoice:
    """One decision of :class:`AdaptiveInterval`, with every input it used (for the log)."""

    seconds: float
    """The interval used: ``daly_s`` clamped to the bounds, or the initial interval."""
    cost_s: float | None
    """C: median blocking time of the recent saves; None before any save was measured."""
    mtbf_s: float
    mtbf_source: str
    daly_s: float | None
    clamped: str | None
    """"min" or "max" when a bound overrode Daly's value."""
    samples: int

    def describe(self) -> str:
        if self.cost_s is None:
            return (
                f"save interval {self.seconds:.1f}s (initial: no save measured yet; "
                f"M={self.mtbf_s:.0f}s {self.mtbf_source})"
            )
        assert self.daly_s is not None
        bound = f", clamped to the {self.clamped} bound" if self.clamped else ""
        return (
            f"save interval {self.seconds:.1f}s (Daly {self.daly_s:.1f}s{bound}; C={self.cost_s:.3f}s, the "
            f"median blocking time of the last {self.samples} save(s); "
            f"M={self.mtbf_s:.0f}s {self.mtbf_source})"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class AdaptiveInterval:
    """``save_every_seconds="auto"``: the interval from measured save cost and the MTBF (Daly 2006).

    A pure function of its inputs: :meth:`choose` takes the measured blocking times and M and returns the
    interval. Pass an instance as ``save_every_seconds=`` to change the defaults.
    """

    min_s: float = 60.0
    """Lower bound. Saving more often than once a minute buys little (the loop needs time to run between
    saves) and churns storage; it also guards against a noisy, tiny measured C."""
    max_s: float = 4 * 3600.0
    """Upper bound. Caps the work at risk if M is wrong (e.g. learned from a short, lucky history)."""
    initial_s: float = 300.0
    """Used until a save has been measured: the first save comes early, so C is known early."""
    prior_mtbf_s: float = 24 * 3600.0
    """M assumed before any failure is seen, as one pseudo-failure (see :func:`learned_mtbf`)."""
    window: int = 5
    """C is the median blocking time of the last ``window`` saves (robust to a slow first save)."""
    mtbf_s: float | None = None
    """M, when known (e.g. a cluster's measured MTBF); None learns it from the restarts this root saw."""

    def __post_init__(self) -> None:
        for name in ("min_s", "max_s", "initial_s", "prior_mtbf_s", "window"):
            _positive(name, getattr(self, name))
        if self.mtbf_s is not None:
            _positive("mtbf_s", self.mtbf_s)
        if not self.min_s <= self.initial_s <= self.max_s:
            raise ValueError(
                f"need min_s <= initial_s <= max_s, got {self.min_s}, {self.initial_s}, {self.max_s}"
            )

    def choose(self, costs: Sequence[float], mtbf_s: float, mtbf_source: str = "given") -> IntervalChoice:
        recent = list(costs)[-self.window :]
        if not recent:
            return IntervalChoice(self.initial_s, None, mtbf_s, mtbf_source, None, None, 0)
        cost = statistics.median(recent)
        daly = daly_interval(cost, mtbf_s)
        clamped = "min" if daly < self.min_s else "max" if daly > self.max_s else None
        seconds = min(self.max_s, max(self.min_s, daly))
        return IntervalChoice(seconds, cost, mtbf_s, mtbf_source, daly, clamped, len(recent))


def learned_mtbf(observed_s: float, failures: int, prior_s: float) -> float:
    """M from a run's history: (observed running time + prior) / (failures + 1).

    The prior counts as one pseudo-failure after ``prior_s`` seconds: with no failure yet M starts at the
    prior and grows as failure-free time accumulates; after many failures it tends to observed/failures.
    """
    if observed_s < 0 or failures < 0:
        raise ValueError(f"need observed_s >= 0 and failures >= 0, got {observed_s!r}, {failures!r}")
    return (observed_s + prior_s) / (failures + 1)


class AdaptiveSeconds:
    """The save policy behind ``save_every_seconds="auto"``: due when the current adaptive interval passed.

    ``costs`` returns the blocking times measured so far (oldest first) and ``mtbf`` returns (M, where it
    came from); the interval is re-chosen, and logged, whenever a new save has been measured.
    """

    def __init__(
        self,
        config: AdaptiveInterval,
        costs: Callable[[], Sequence[float]],
        mtbf: Callable[[], tuple[float, str]],
    ) -> None:
        self.config = config
        self._costs = costs
        self._mtbf = mtbf
        self._measured = -1
        self.choice = self._choose()

    @property
    def seconds(self) -> float:
        return self.choice.seconds

    def _choose(self) -> IntervalChoice:
        costs = self._costs()
        self._measured = len(costs)
        choice = self.config.choose(costs, *self._mtbf())
        log.info("safepoint: %s", choice.describe())
        return choice

    def due(self, step: int, now: float, last_step: int | None, last_time: float) -> bool:
        if len(self._costs()) != self._measured:
            self.choice = self._choose()
        return now - last_time >= self.choice.seconds


TIME_POLICIES = (EveryNSeconds, AdaptiveSeconds)
"""Policies whose decision depends on each rank's clock: ranks must agree before acting on them."""


def parse_interval(
    value: float | str | AdaptiveInterval | None,
) -> tuple[float | None, AdaptiveInterval | None]:
    """``save_every_seconds`` as (a fixed interval, an adaptive configuration); at most one is set."""
    if value is None:
        return None, None
    if isinstance(value, AdaptiveInterval):
        return None, value
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f"save_every_seconds must be a number of seconds or 'auto', got {value!r}")
        return None, AdaptiveInterval()
    _positive("save_every_seconds", value)
    return float(value), None


# ---- what to keep ------------------------------------------------------------------------------------


class RetentionPolicy(Protocol):
    def keep(self, history: Sequence[CheckpointInfo]) -> set[int]: ...


@dataclasses.dataclass(frozen=True, slots=True)
class KeepLast:
    """The newest ``n`` checkpoints (``Keep(last=n)``)."""

    n: int
    """How many of the newest to keep."""

    def __post_init__(self) -> None:
        _positive("KeepLast.n", self.n)

    def keep(self, history: Sequence[CheckpointInfo]) -> set[int]:
        return {c.step for c in sorted(history, key=lambda c: c.step)[-self.n :]}


@dataclasses.dataclass(frozen=True, slots=True)
class KeepEvery:
    """Milestones: keep every checkpoint whose step is a multiple of ``steps`` (``Keep(every_steps=...)``)."""

    steps: int
    """The milestone period in steps."""

    def __post_init__(self) -> None:
        _positive("KeepEvery.steps", self.steps)

    def keep(self, history: Sequence[CheckpointInfo]) -> set[int]:
        return {c.step for c in history if c.step % self.steps == 0}


@dataclasses.dataclass(frozen=True, slots=True)
class KeepBest:
    """The ``n`` best checkpoints by ``metric`` (ties go to the newer): ``Keep(best=KeepBest(2,
    metric="loss", mode="min"))``. Checkpoints without the metric do not compete."""

    n: int
    """How many of the best to keep."""
    metric: str
    """The name of a metric passed to ``save``/``maybe_save`` (``metrics={"loss": ...}``)."""
    mode: str = "min"
    """"min" (lower is better, e.g. a loss) or "max" (e.g. an accuracy)."""

    def __post_init__(self) -> None:
        _positive("KeepBest.n", self.n)
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"KeepBest.metric must be a metric's name, got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"KeepBest.mode must be 'min' or 'max', got {self.mode!r}")

    def keep(self, history: Sequence[CheckpointInfo]) -> set[int]:
        scored = [c for c in history if self.metric in c.metrics]
        sign = 1.0 if self.mode == "min" else -1.0
        scored.sort(key=lambda c: (sign * c.metrics[self.metric], -c.step))
        return {c.step for c in scored[: self.n]}


@dataclasses.dataclass(frozen=True, slots=True)
class Retention:
    """Union of policies. No policy keeps everything. ``protect`` always survives: the one just committed
    and the newest *verified* checkpoint (a newer step that failed or never had verification must not
    stand in for it). Without ``protect`` the newest checkpoint is never deleted."""

    policies: tuple[RetentionPolicy, ...] = ()

    def to_delete(
        self, history: Sequence[CheckpointInfo], protect: Collection[int] | None = None
    ) -> list[int]:
        if not self.policies or not history:
            return []
        keep: set[int] = set(protect) if protect is not None else {max(c.step for c in history)}
        for p in self.policies:
            keep |= p.keep(history)
        return sorted(c.step for c in history if c.step not in keep)


class Verdicts:
    """What verification found in this process, per step: intact (True) or corrupt (False). Restore
    records every step it verifies; retention keeps the newest intact one and never counts a corrupt one
    (it is left alone: neither kept by a policy nor deleted). A step this process commits again is
    forgotten (its bytes changed)."""

    def __init__(self) -> None:
        self._found: dict[int, bool] = {}

    def record(self, step: int, intact: bool) -> None:
        self._found[step] = intact

    def forget(self, step: int) -> None:
        self._found.pop(step, None)

    def corrupt(self, step: int) -> bool:
        return self._found.get(step) is False

    def newest_intact(self, steps: Collection[int]) -> int | None:
        good = [s for s in steps if self._found.get(s) is True]
        return max(good) if good else None


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
