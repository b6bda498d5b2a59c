"""Finding a sharded tensor (DTensor, ShardedTensor) in a value saved per rank, which cannot hold one."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def check_not_sharded(key: str, value: Any) -> None:
    """A sharded tensor in per-rank ``extra`` fails DCP's global plan only at the first save (``invalid
    fill tensor-volume``), possibly long into the run: refuse it when the TrainState is built."""
    found = sharded_path(value.state_dict() if hasattr(value, "state_dict") else value, key)
    if found is not None:
        raise ValueError(
            f"TrainState(extra={{{key!r}: ...}}) holds a sharded tensor ({found}); extra is saved per rank "
            "and cannot hold sharded state. Pass it as a named section instead: "
            f"TrainState(modules={{{key!r}: module}}, optimizers={{{key!r}: optimizer}}) for a module, "
            f"or objects={{{key!r}: obj}} for another Stateful object"
        )


def sharded_path(value: Any, path: str) -> str | None:
    if isinstance(value, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor) or type(value).__name__ == "ShardedTensor":
            return path
        return None
    if isinstance(value, dict):
        items: Iterable[tuple[Any, Any]] = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for k, v in items:
        found = sharded_path(v, f"{path}.{k}")
        if found is not None:
            return found
    return None
