"""A minimal Stateful for ``TrainState(objects=...)``: one value under the key ``"v"``, set back as loaded."""

from __future__ import annotations

from typing import Any


class Holder:
    def __init__(self, v: Any) -> None:
        self.v = v

    def state_dict(self) -> dict[str, Any]:
        return {"v": self.v}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.v = sd["v"]
