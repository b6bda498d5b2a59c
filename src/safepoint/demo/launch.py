"""One torchrun launch of the demo as it happened: its world size, exit code, times and the workers' events.

Its own module so that the report and the plot both read it without importing each other.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class LaunchResult:
    name: str
    role: str  # "run" (the faulty run) or "reference"
    world: int
    rc: int
    t_start: float
    t_end: float
    events: list[dict[str, Any]]

    def of(self, event: str, rank: int | None = 0) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event and (rank is None or e["rank"] == rank)]
