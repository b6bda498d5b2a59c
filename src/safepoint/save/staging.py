"""stage: copy a captured state dict into host buffers that are allocated once and reused.

The copy is the only part of an async save that blocks training. Buffers are reused while the state keeps
its shape, so 100 saves cost one buffer set, not 100 (the Orbax #1640 / NeMo OOM failure). On CUDA they
are pinned, so the device-to-host copy runs at full bandwidth. The copy and the buffer allocation (DTensor,
ShardedTensor, nested containers) are DCP's own, from torch.distributed._state_dict_utils. The "can these
buffers take this state?" check is ours: torch's ``_check_state_dict_similarity`` walks the state with
the buffers as companion object, and that walk ``copy_``s every tensor into the companion as a side effect,
so using it made every save copy the whole state twice (2x the blocking time; measured in
benchmarks/bench_async.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.tensor import DTensor

from safepoint.save.shared_buffers import SharedArena, buffer_tensors, move_into_arena

log = logging.getLogger("safepoint")


def _any_cuda(sd: Any) -> bool:
    return any(t.is_cuda for t in buffer_tensors(sd))


def _cuda_devices(sd: Any) -> set[torch.device]:
    return {t.device for t in buffer_tensors(sd) if t.is_cuda}


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

    def __init__(self, *, shared: bool = False, before_alloc: Callable[[], None] | None = None) -> None:
        self._buffers: dict[str, Any] | None = None
        self.allocations = 0
        # shared: the buffers live in one shared-memory segment that a writer process maps (see
        # shared_buffers.py); ``arena`` is the segment of the current buffer set.
        self._shared = shared
        self.arena: SharedArena | None = None
        # Called after the old buffers are dropped, before new ones are allocated: the writer process
        # unmaps its view of the old segment, so two sets never exist at once.
        self._before_alloc = before_alloc
        self._stream: torch.cuda.Stream | None = None  # the side stream of the device-to-host copy (CUDA)
        self.nbytes = 0
        """Tensor bytes of the current buffer set (what each ``stage`` copies), counted once per set."""

    def stage(self, sd: dict[str, Any]) -> dict[str, Any]:
        if self._buffers is None or not _similar(sd, self._buffers):
            cuda = _any_cuda(sd)
            if self._buffers is not None:
                log.info("safepoint: state changed shape; reallocating staging buffers")
            self.release()  # drop the old set first: never two sets alive at once
            if self._before_alloc is not None:
                self._before_alloc()
            pin = cuda and torch.cuda.is_available()
            if self._shared:
                buffers = _create_cpu_state_dict(sd)  # untouched pages: re-homed below without a copy
                self.arena = move_into_arena(buffers, pin=pin)
                self._buffers = buffers
            else:
                self._buffers = _create_cpu_state_dict(sd, pin_memory=pin)
            self.allocations += 1
            self.nbytes = tensor_bytes(self._buffers)
        devices = _cuda_devices(sd) if torch.cuda.is_available() else set()
        if len(devices) != 1:
            snapshot: dict[str, Any] = _copy_state_dict(
                sd, self._buffers, non_blocking=True, type_check=False
            )
            if devices:
                torch.cuda.synchronize()  # non_blocking D2H copies must land before the writer reads them
            return snapshot
        return self._copy_on_side_stream(sd, devices.pop())

    def _copy_on_side_stream(self, sd: dict[str, Any], device: torch.device) -> dict[str, Any]:
        """The device-to-host copy on a stream of its own, synchronised alone.

        The side stream first waits for the work queued so far on the training's current stream, so the
        copy sees every update the loop issued before ``save`` (stream order, not a device-wide barrier).
        Only that stream is then synchronised: work other streams queued (a prefetch, NCCL) does not
        lengthen the block, as a ``torch.cuda.synchronize()`` would make it. The copies go into pinned
        buffers, so they are DMA transfers that need no staging copy of their own. The source
        tensors stay referenced by ``sd`` until the stream is synchronised, so the caching allocator
        cannot hand their memory to the loop while the copy still reads it.
        """
        assert self._buffers is not None
        with torch.cuda.device(device):
            if self._stream is None or self._stream.device != device:
                self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                snapshot: dict[str, Any] = _copy_state_dict(
                    sd, self._buffers, non_blocking=True, type_check=False
                )
            self._stream.synchronize()
        return snapshot

    def release(self) -> None:
        self._buffers = None
        self.nbytes = 0
        if self.arena is not None:
            self.arena.release()  # the memory goes with the last tensor that maps it
            self.arena = None


def _similar(sd: Any, buffers: Any) -> bool:
    """Whether ``buffers`` can receive ``sd``: same keys, lengths, tensor kinds, shapes and dtypes.

    Structural only, it touches no tensor data (see the module docstring for why not torch's check).
    Non-tensor leaves are copied by value, so any buffer entry will do for them.
    """
    if isinstance(sd, ShardedTensor):
        if not isinstance(buffers, ShardedTensor):
            return False
        mine, theirs = sd.local_shards(), buffers.local_shards()
        return len(mine) == len(theirs) and all(
            _same_tensor(a.tensor, b.tensor) for a, b in zip(mine, theirs, strict=True)
        )
    if isinstance(sd, DTensor):
        return (
            isinstance(buffers, DTensor)
            and _same_tensor(sd, buffers)
            and _same_tensor(sd._local_tensor, buffers._local_tensor)
        )
    if isinstance(sd, torch.Tensor):
        return (
            isinstance(buffers, torch.Tensor)
            and not isinstance(buffers, (DTensor, ShardedTensor))
            and _same_tensor(sd, buffers)
        )
    if isinstance(sd, dict):
        return (
            isinstance(buffers, dict)
            and sd.keys() == buffers.keys()
            and all(_similar(v, buffers[k]) for k, v in sd.items())
        )
    if isinstance(sd, (list, tuple)):
        return (
            isinstance(buffers, (list, tuple))
            and len(sd) == len(buffers)
            and all(_similar(a, b) for a, b in zip(sd, buffers, strict=True))
        )
    return True


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.size() == b.size()
