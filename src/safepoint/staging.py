"""stage: copy a captured state dict into host buffers that are allocated once and reused.

The copy is the only part of an async save that blocks training. Buffers are reused while the state keeps
its shape, so 100 saves cost one buffer set, not 100 (the Orbax #1640 / NeMo OOM failure). On CUDA they
are pinned, so the device-to-host copy runs at full bandwidth. The traversal (DTensor, ShardedTensor,
nested containers) is DCP's own, from torch.distributed._state_dict_utils, not a re-implementation.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed._state_dict_utils import (
    _check_state_dict_similarity,
    _copy_state_dict,
    _create_cpu_state_dict,
)

log = logging.getLogger("safepoint")


def _any_cuda(sd: Any) -> bool:
    if isinstance(sd, torch.Tensor):
        return sd.is_cuda
    if isinstance(sd, dict):
        return any(_any_cuda(v) for v in sd.values())
    if isinstance(sd, (list, tuple)):
        return any(_any_cuda(v) for v in sd)
    return False


def tensor_bytes(sd: Any) -> int:
    if isinstance(sd, torch.Tensor):
        local = sd.to_local() if hasattr(sd, "to_local") else sd
        return int(local.numel() * local.element_size())
    if isinstance(sd, dict):
        return sum(tensor_bytes(v) for v in sd.values())
    if isinstance(sd, (list, tuple)):
        return sum(tensor_bytes(v) for v in sd)
    return 0


class Stager:
    """Holds one set of host buffers; ``stage`` returns a consistent snapshot living in them.

    The snapshot is valid until the next ``stage`` call: the caller keeps at most one save in flight.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Any] | None = None
        self.allocations = 0

    def stage(self, sd: dict[str, Any]) -> dict[str, Any]:
        if self._buffers is None or not _similar(sd, self._buffers):
            cuda = _any_cuda(sd)
            if self._buffers is not None:
                log.info("safepoint: state changed shape; reallocating staging buffers")
            self._buffers = None  # drop the old set first: never two sets alive at once
            self._buffers = _create_cpu_state_dict(sd, pin_memory=cuda and torch.cuda.is_available())
            self.allocations += 1
        snapshot: dict[str, Any] = _copy_state_dict(sd, self._buffers, non_blocking=True, type_check=False)
        if torch.cuda.is_available() and _any_cuda(sd):
            # non_blocking D2H copies must land before the writer thread reads the buffers.
            torch.cuda.synchronize()
        return snapshot

    def release(self) -> None:
        self._buffers = None


def _similar(sd: dict[str, Any], buffers: dict[str, Any]) -> bool:
    try:
        return bool(_check_state_dict_similarity(sd, buffers))
    except Exception:  # a structural mismatch in any form means "reallocate"
        return False
