"""keep: what retention keeps, as the one object ``CheckpointManager(keep=...)`` takes.

``Keep`` names the common rules by field and builds the composable policy objects of rules.py from them
(``KeepLast``, ``KeepEvery``, ``KeepBest``): what each keeps is kept (their union), and the checkpoint just
committed and the newest verified one always survive. One object rather than five flat keywords because the
rules only mean something together (``best`` needs its metric and mode; ``local_last`` only with tiering).
"""

from __future__ import annotations

import dataclasses

from safepoint.policy.rules import KeepBest, KeepEvery, KeepLast, Retention, RetentionPolicy


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Keep.{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Keep:
    """Retention: ``CheckpointManager(keep=safepoint.Keep(last=3, every_steps=1000,
    best=safepoint.KeepBest(2, metric="loss", mode="min")))``. Rules left as None keep nothing by themselves;
    ``Keep()`` (the default) keeps every checkpoint. See docs/concepts.md ("Retention")."""

    last: int | None = None
    """Keep the newest ``last`` checkpoints."""
    every_steps: int | None = None
    """Milestones: keep every checkpoint whose step is a multiple of this (e.g. 1000), forever."""
    best: KeepBest | None = None
    """Keep the ``n`` best by a metric passed to ``save``/``maybe_save``:
    ``safepoint.KeepBest(n, metric="loss", mode="min")``. Checkpoints without the metric do not compete."""
    local_last: int = 1
    """With ``local_root`` (tiering): local copies kept on the fast disk. A copy that is not durable yet is
    never removed. The rules above apply to the durable root."""

    def __post_init__(self) -> None:
        for name in ("last", "every_steps"):
            if (value := getattr(self, name)) is not None:
                _positive_int(name, value)
        if self.best is not None and not isinstance(self.best, KeepBest):
            raise ValueError(
                f"Keep.best takes a safepoint.KeepBest(n, metric=..., mode=...), got {self.best!r}"
            )
        _positive_int("local_last", self.local_last)

    @property
    def policies(self) -> tuple[RetentionPolicy, ...]:
        """The rules as policy objects (rules.py), in the order of the fields."""
        rules: list[RetentionPolicy] = []
        if self.last is not None:
            rules.append(KeepLast(self.last))
        if self.every_steps is not None:
            rules.append(KeepEvery(self.every_steps))
        if self.best is not None:
            rules.append(self.best)
        return tuple(rules)

    def retention(self) -> Retention:
        """The union of :attr:`policies`; no rule at all keeps everything."""
        return Retention(self.policies)

    @classmethod
    def of(cls, keep: Keep | None) -> Keep:
        """``keep=`` as given (None: keep all); anything else fails by name."""
        if keep is None:
            return cls()
        if not isinstance(keep, cls):
            raise TypeError(f"keep= takes a safepoint.Keep, got {type(keep).__name__}")
        return keep
