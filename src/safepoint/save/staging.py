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
from safepoint.store.fingerprint import fast_path, fingerprints

Alias = tuple[Any, ...]
"""What makes two tensors the very same values: (device, data_ptr, dtype, shape, strides, conj, neg)."""

log = logging.getLogger("safepoint")

FINGERPRINT_CUDA_WHEN_STAGING: bool | None = None
"""The policy for a CUDA tensor whose version counter did not move since async staging last copied it:
prove it unchanged on the GPU (no host copy) or copy it and let the writer fingerprint the host copy in the
background. ``None`` (the default): on the GPU when the fused Triton kernel fingerprints tensors on that
device (``fingerprint.fast_path``: Triton imports, compiles, and matches the torch ops there), which reads
the bytes about once, far cheaper than the copy it spares, for tensors of at least
``FINGERPRINT_CUDA_MIN_BYTES``; without the kernel, copy: the torch-ops fingerprint reads ~15 GB/s on an
H100, 3.7x slower than the pinned copy, and it runs inside the loop's blocking time (a 2 GiB state's async
save blocked 144 ms with it against 66 ms without; docs/benchmarks.md, "The GPU path"). ``True``: every
CUDA tensor on the GPU (the torch ops where the kernel is not usable); ``False``: always copy. Sync saves
fingerprint on the GPU either way (there it spares a copy *and* a host hash)."""

FINGERPRINT_CUDA_MIN_BYTES = 1 << 20
"""Under the default policy, smaller CUDA tensors are copied, not fingerprinted: a small tensor's cost is
the host's per-tensor work, not its bytes. A pinned copy costs ~7 us of launch plus 1 us per ~50 KB (the
9,000-tensor state of docs/benchmarks.md: 73 ms), a fingerprint ~15 us of Python bookkeeping per tensor
(the torch-ops path's 2,000 x 1 KiB: 44 ms) whatever its size, so fingerprinting pays from a few hundred
KiB; 1 MiB keeps a margin. ``benchmarks/bench_fingerprint.py`` measures both per tensor on a GPU."""


def cuda_fingerprint_floor(device: torch.device) -> int | None:
    """The smallest CUDA tensor on ``device``, in bytes, that async staging fingerprints on the GPU rather
    than copies (``FINGERPRINT_CUDA_WHEN_STAGING``); None: it copies them all."""
    if FINGERPRINT_CUDA_WHEN_STAGING is None:
        return FINGERPRINT_CUDA_MIN_BYTES if fast_path(device) else None
    return 0 if FINGERPRINT_CUDA_WHEN_STAGING else None


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
        # Incremental staging: what each buffer holds (by id of the buffer tensor). ``_held``: the
        # fingerprint of the bytes last copied into it; ``_seen``: (data_ptr, autograd version) of the live
        # tensor then. Both go with the buffers.
        self._held: dict[int, bytes | None] = {}
        self._seen: dict[int, tuple[int, int]] = {}
        # The buffers whose live tensor the last staging proved unchanged (not copied).
        self._still: set[int] = set()
        self._ties: list[tuple[int, int]] = []
        self.fingerprints: dict[Alias, bytes | None] = {}
        """Of the last ``stage``: the fingerprint of each buffer whose bytes it proved (the writer's
        incremental layer uses them instead of hashing the staged copy again: store/incremental.py), None
        for a buffer copied because the tensor's version counter moved (written, not hashed)."""
        self.skipped = 0
        """Bytes the last ``stage`` did not copy: tensors proven unchanged since the buffers got them."""

    def stage(self, sd: dict[str, Any]) -> dict[str, Any]:
        ties = _ties(sd)
        # The CUDA devices the state lives on (none without CUDA): pinned buffers, and the copy's stream.
        devices = _cuda_devices(sd) if torch.cuda.is_available() else set()
        if self._buffers is None or not _similar(sd, self._buffers) or ties != self._ties:
            if self._buffers is not None:
                log.info("safepoint: state changed shape; reallocating staging buffers")
            self.release()  # drop the old set first: never two sets alive at once
            if self._before_alloc is not None:
                self._before_alloc()
            pin = bool(devices)
            if self._shared:
                buffers = _create_cpu_state_dict(sd)  # untouched pages: re-homed below without a copy
                _tie_buffers(sd, buffers)
                self.arena = move_into_arena(buffers, pin=pin)
                self._buffers = buffers
            else:
                self._buffers = _create_cpu_state_dict(sd, pin_memory=pin)
                _tie_buffers(sd, self._buffers)
            self._ties = ties
            self.allocations += 1
            self.nbytes = tensor_bytes(self._buffers)
        if len(devices) != 1:
            snapshot = self._copy(sd, self._buffers)
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
                # The fingerprints of the incremental check run here too, after the loop's queued work.
                snapshot = self._copy(sd, self._buffers)
            self._stream.synchronize()
        return snapshot

    def _copy(self, sd: dict[str, Any], buffers: dict[str, Any]) -> dict[str, Any]:
        """Copy ``sd`` into ``buffers``, except the plain tensors proven unchanged since their buffer got
        their bytes: the version counter is a hint in one direction only (moved: copied, no fingerprint);
        "unchanged" needs the fingerprint, computed where the tensor lives (GPU tensors on the GPU, so an
        unchanged one costs no device-to-host copy). A tied tensor (one buffer, two keys) is copied once."""
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        snapshot: dict[str, Any] = _walk(sd, buffers, pairs)
        todo: list[tuple[torch.Tensor, torch.Tensor]] = []
        check: list[tuple[torch.Tensor, torch.Tensor]] = []
        done: set[int] = set()
        moved: list[torch.Tensor] = []
        cuda = {live.device for live, _ in pairs if live.is_cuda}
        floor = {device: cuda_fingerprint_floor(device) for device in cuda}  # the policy, per device
        for live, buf in pairs:
            if id(buf) in done:
                continue  # tied: the same buffer for another key of the same tensor
            done.add(id(buf))
            version = (live.data_ptr(), live._version)
            seen, self._seen[id(buf)] = self._seen.get(id(buf)), version
            written = seen is not None and seen[0] == version[0] and seen[1] != version[1]
            # A tensor the previous staging proved unchanged that has just been written is fingerprinted
            # anyway: with its new fingerprint recorded, the next save can prove it unchanged again
            # (store/incremental.py) instead of writing it a second time unhashed. One that changes at
            # every save is not (the fingerprint would only ever say "changed").
            if written and id(buf) not in self._still:
                self._held[id(buf)] = None  # written to since: copied, not fingerprinted
                todo.append((live, buf))
                moved.append(buf)
            elif live.is_cuda and (
                (least := floor[live.device]) is None or live.numel() * live.element_size() < least
            ):
                self._held[id(buf)] = None  # copied; the writer fingerprints the host copy, off the loop
                todo.append((live, buf))
            else:
                check.append((live, buf))
        self.skipped = 0
        self._still = set()
        # None: its counter moved, so it may have changed: the writer writes it without hashing it (a sync
        # save does the same with the live tensor; "unchanged" is never decided without a fingerprint).
        self.fingerprints = {_alias(buf): None for buf in moved}
        for (live, buf), fp in zip(check, fingerprints([t.detach() for t, _ in check]), strict=True):
            if fp is not None:
                # The buffer holds exactly the bytes this fingerprint proved (copied below, or already
                # there): the writer uses it rather than hashing the staged copy again.
                self.fingerprints[_alias(buf)] = fp
            if fp is not None and self._held.get(id(buf)) == fp:
                self.skipped += buf.numel() * buf.element_size()
                self._still.add(id(buf))
                continue
            self._held[id(buf)] = fp
            todo.append((live, buf))
        with torch.no_grad():
            for live, buf in todo:
                buf.copy_(live.detach(), non_blocking=True)
        return snapshot

    def release(self) -> None:
        self._held, self._seen, self._ties, self._still = {}, {}, [], set()
        self._buffers = None
        self.nbytes = 0
        if self.arena is not None:
            self.arena.release()  # the memory goes with the last tensor that maps it
            self.arena = None


def _plain(t: Any) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
    )


def _alias(t: torch.Tensor) -> Alias:
    # The conj and neg bits too: ``z.conj()`` is the same memory, dtype and view as ``z`` but other values.
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.is_conj(), t.is_neg())


def _walk(sd: Any, buffers: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """The snapshot of ``sd`` in ``buffers`` (the same structure, the buffers in place of the tensors),
    collecting (live, buffer) for every plain tensor; anything else is copied as torch's
    ``_copy_state_dict`` copies it (DTensor and ShardedTensor locals, non-tensor values)."""
    if _plain(sd) and _plain(buffers):
        pairs.append((sd, buffers))
        return buffers
    if isinstance(sd, dict) and isinstance(buffers, dict):
        return {k: _walk(v, buffers[k], pairs) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)) and isinstance(buffers, (list, tuple)):
        out = [_walk(a, b, pairs) for a, b in zip(sd, buffers, strict=True)]
        return tuple(out) if isinstance(sd, tuple) else out
    return _copy_state_dict({"v": sd}, {"v": buffers}, non_blocking=True, type_check=False)["v"]


def _leaves(sd: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], torch.Tensor]]:
    """(path, tensor) of every plain, non-empty tensor in dicts and lists (tuples cannot share a buffer)."""
    if _plain(sd):
        return [(path, sd)] if sd.numel() else []
    if isinstance(sd, dict):
        return [leaf for k, v in sd.items() for leaf in _leaves(v, (*path, k))]
    if isinstance(sd, list):
        return [leaf for i, v in enumerate(sd) for leaf in _leaves(v, (*path, i))]
    return []


def _ties(sd: Any) -> list[tuple[int, int]]:
    """Pairs (i, j) of leaf positions that are the very same tensor (tied weights), j > i."""
    first: dict[Alias, int] = {}
    out = []
    for i, (_, t) in enumerate(_leaves(sd)):
        key = _alias(t)
        if key in first:
            out.append((first[key], i))
        else:
            first[key] = i
    return out


def _tie_buffers(sd: Any, buffers: Any) -> None:
    """Give tied tensors one buffer: staged once, written once (store/incremental.py writes an item that
    is the same view of the same memory as another once), and both keys load."""
    live, bufs = _leaves(sd), _leaves(buffers)
    for i, j in _ties(sd):
        path, shared = bufs[j][0], bufs[i][1]
        if len(bufs) != len(live) or not path:
            return
        container = buffers
        for k in path[:-1]:
            container = container[k]
        container[path[-1]] = shared


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
