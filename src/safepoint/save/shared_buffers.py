"""Staging buffers in one shared-memory segment, so a writer process reads them in place (no second copy).

torch's own ``share_memory_()`` gives every tensor its own shared segment and keeps one file descriptor
open per tensor: a model with thousands of parameters (times three with Adam) runs into the default
open-file limit (1024), and the segments live in /dev/shm, which containers often cap at 64 MiB. So the
buffers live in one ``memfd`` (anonymous shared memory, no /dev/shm, one descriptor), mapped once here and
once in the writer process. Each tensor gets its own storage over exactly its bytes of the segment, so
DCP's writer sees an ordinary tensor (a view of a bigger storage would make it clone the data).
"""

from __future__ import annotations

import itertools
import mmap
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.tensor import DTensor

from safepoint.save.wrappers import inner_tensors, stageable

# Each tensor starts on a cache line: copies into the buffers and the writer's reads stay aligned.
ALIGN = 64
# The packed tensors (``move_into_arena``'s ``first``) start on a multiple of the largest element size
# (complex128), so that each one's offset from any other is a multiple of its own element size.
PACK_ALIGN = 16
_ids = itertools.count(1)


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


class SharedArena:
    """One anonymous shared-memory segment of ``nbytes``, carved into per-tensor storages."""

    def __init__(self, fd: int, nbytes: int, arena_id: str) -> None:
        """Map ``nbytes`` of the segment behind ``fd`` (this object owns ``fd``); see create/attach."""
        self.fd, self.nbytes, self.id = fd, nbytes, arena_id
        try:
            self._map = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        self.base_ptr = torch.frombuffer(self._map, dtype=torch.uint8).data_ptr()
        self._pinned = False
        self.packed = 0
        """The leading bytes that hold only the tensors ``move_into_arena`` packed (``first``)."""

    @classmethod
    def create(cls, nbytes: int, *, pin: bool = False) -> SharedArena:
        """A new zero-filled segment (its pages are allocated as they are first written)."""
        if not hasattr(os, "memfd_create"):
            raise OSError("a process writer needs Linux (memfd_create); use async_writer='thread'")
        nbytes = max(int(nbytes), 1)
        fd = os.memfd_create("safepoint-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        arena = cls(fd, nbytes, f"{os.getpid()}-{next(_ids)}")  # never reused: the writer maps by id
        if pin:
            # Page-locked, so device-to-host copies into it run at full bandwidth (as torch's
            # _create_cpu_state_dict does for shared, pinned buffers).
            rc = int(_cudart().cudaHostRegister(arena.base_ptr, nbytes, 1))
            if rc != 0:
                arena.release()
                raise RuntimeError(f"pinning {nbytes} bytes of staging memory failed (cudaError {rc})")
            arena._pinned = True
        return arena

    @classmethod
    def attach(cls, fd: int, nbytes: int, arena_id: str) -> SharedArena:
        """The writer process's view of a segment whose descriptor it received (takes ``fd``)."""
        return cls(fd, nbytes, arena_id)

    def storage(self, offset: int, nbytes: int) -> torch.UntypedStorage:
        """A storage over exactly ``nbytes`` of the segment at ``offset`` (it keeps the mapping alive)."""
        view = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=offset)
        return view.untyped_storage()

    def bytes_at(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over ``nbytes`` of the segment at ``offset`` (it keeps the mapping alive)."""
        return torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=offset)

    def offset_of(self, ptr: int, nbytes: int) -> int | None:
        """Where ``[ptr, ptr + nbytes)`` lies in the segment, or None if it is not inside it."""
        off = ptr - self.base_ptr
        return off if off >= 0 and off + nbytes <= self.nbytes else None

    def release(self) -> None:
        """Give up this side's descriptor; the memory goes once no tensor maps it any more."""
        if self._pinned:
            _cudart().cudaHostUnregister(self.base_ptr)
            self._pinned = False
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def buffer_tensors(buffers: Any) -> Iterator[torch.Tensor]:
    """The plain tensors holding the data of a (nested) state dict: DTensor locals, ShardedTensor shards, a
    wrapper subclass's inner tensors (save/wrappers.py)."""
    if isinstance(buffers, ShardedTensor):
        for shard in buffers.local_shards():
            yield shard.tensor
    elif isinstance(buffers, DTensor):
        yield buffers._local_tensor
    elif stageable(buffers):
        yield from inner_tensors(buffers)
    elif isinstance(buffers, torch.Tensor):
        yield buffers
    elif isinstance(buffers, dict):
        for v in buffers.values():
            yield from buffer_tensors(v)
    elif isinstance(buffers, (list, tuple)):
        for v in buffers:
            yield from buffer_tensors(v)


def move_into_arena(buffers: Any, *, pin: bool, first: Sequence[torch.Tensor] = ()) -> SharedArena:
    """Re-home every staging tensor of ``buffers`` into one new SharedArena (in place, shapes unchanged).

    ``first`` (tensors of ``buffers``): laid at the start of the segment, in that order, each at the next
    multiple of ``PACK_ALIGN`` after the one before; the segment's ``packed`` bytes hold them and nothing
    else (save/gather.py copies them in a few large transfers, gaps included).

    Zero-size tensors stay where they are (no bytes to map: sent to the writer by value), and so does a
    one-element tensor that is not a plain CPU tensor over a storage of its own. The other 0-d and
    one-element tensors (Adam's ``step``: one per parameter) move too: sent by value they cost the rank a
    lookup, a copy into bytes and a pickle each at every save (~15 us each, 3,000 of them at 3,000
    parameters); in the segment, a steady save sends nothing for them (handoff.py).
    """
    tensors: list[torch.Tensor] = []
    offsets: list[int] = []
    seen: set[int] = set()
    total, packed = 0, None
    for align, group in ((PACK_ALIGN, first), (ALIGN, buffer_tensors(buffers))):
        if packed is None and group is not first:
            packed = total  # the end of ``first``'s bytes: what follows starts on ALIGN past it
        total = -(-total // align) * align
        for t in group:
            if t.numel() == 0 or id(t) in seen or (t.numel() == 1 and not _own_cpu_storage(t)):
                continue
            seen.add(id(t))
            tensors.append(t)
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // align) * align
    arena = SharedArena.create(total, pin=pin)
    arena.packed = packed or 0
    with torch.no_grad():
        for t, off in zip(tensors, offsets, strict=True):
            nbytes = t.numel() * t.element_size()
            # A one-element buffer keeps its value (a 0-d DTensor's private copy holds the live value:
            # stage_buffers.own_copies). Never the big ones: the fresh buffer from _create_cpu_state_dict was
            # never touched (no resident pages), so swapping its storage costs no copy and no second set
            # of memory.
            value = t.clone() if t.numel() == 1 else None
            t.set_(arena.storage(off, nbytes), 0, t.size(), t.stride())
            if value is not None:
                t.copy_(value)
    return arena


def _own_cpu_storage(t: torch.Tensor) -> bool:
    """A plain CPU tensor laid over the start of a storage of its own bytes (what the buffers of
    ``_create_cpu_state_dict`` are): re-homing it changes no other tensor."""
    return (
        type(t) is torch.Tensor
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )
