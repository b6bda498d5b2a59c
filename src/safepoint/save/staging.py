"""stage: copy a captured state dict into host buffers that are allocated once and reused.

The copy is the only part of an async save that blocks training. Buffers are reused while the state keeps
its shape, so 100 saves cost one buffer set, not 100 (the Orbax #1640 / NeMo OOM failure). On CUDA they
are pinned, so the device-to-host copy runs at full bandwidth. The copy and the buffer allocation (DTensor,
ShardedTensor, nested containers) are DCP's own, from torch.distributed._state_dict_utils. The "can these
buffers take this state?" check is ours: torch's ``_check_state_dict_similarity`` walks the state with
the buffers as companion object, and that walk ``copy_``s every tensor into the companion as a side effect,
so using it made every save copy the whole state twice (2x the blocking time; measured in
benchmarks/bench_async.py). It is one walk of the state per save, which also builds the snapshot and pairs
each tensor with its buffer (save/stage_plan.py), and the copy is one ``torch._foreach_copy_``.

Every value of a snapshot is a copy that no later write to the live state reaches: the writer reads it after
``save()`` has returned, while training goes on. torch's ``_create_cpu_state_dict`` returns a 0-d DTensor as
it is (a DTensor-wrapped scalar parameter and its Adam moments under FSDP2 or tensor parallelism), and it
was once staged into itself, so the next optimizer step reached the checkpoint being written; such an item
now gets a private host copy when the buffers are made (``stage_buffers.own_copies``), at no per-save cost.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import compress
from typing import Any

import torch

from safepoint.errors import SaveError, describe_exception
from safepoint.events import SaveCall
from safepoint.save.gather import Split, gather_picks, gatherable, plan_gather
from safepoint.save.shared_buffers import SharedArena, move_into_arena
from safepoint.save.stage_buffers import own_copies, staged_form, tie_buffers
from safepoint.save.stage_plan import Plan, Walked, cuda_devices, walk
from safepoint.save.wrappers import copy_opaque, cpu_buffers, inner_tensors, stageable
from safepoint.store.fingerprint import fast_path, fingerprints, version_counter

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


FINGERPRINT_CPU_MIN_BYTES = 16 << 10
"""Smaller CPU tensors are copied at async staging, not fingerprinted, whether or not their version counter
moved; the writer fingerprints the staged copy, off the loop, and still links the tensor when it is
unchanged since the last checkpoint. A fingerprint on the loop costs ~3 us of Python per tensor (the
eligibility check, the header, the hash call) before its bytes, a copy inside the batched
``torch._foreach_copy_`` ~1 us: at 16 KiB ~5 us against ~3 us, even at ~64 KiB (measured on this project's
2-core CPU, docs/benchmarks.md "Per-tensor work in the blocking path"). What it spares the loop: the 0-d
``step`` counters of Adam, one per parameter, that a partly frozen model leaves unchanged (3,000 of them,
19 ms per save at 9,000 tensors); what it costs: the copy of a few KiB that could have been skipped."""


def copied_unproven(t: torch.Tensor, nbytes: int) -> bool:
    """Whether async staging copies ``t`` (of ``nbytes``) without fingerprinting it, whatever its version
    counter says: a CPU tensor under ``FINGERPRINT_CPU_MIN_BYTES``, a CUDA tensor under its device's
    ``cuda_fingerprint_floor`` (or any, where the policy copies them all). Either way the writer fingerprints
    the staged copy; "unchanged" is still decided by a fingerprint alone."""
    if t.is_cpu:
        return nbytes < FINGERPRINT_CPU_MIN_BYTES
    if t.is_cuda:
        least = cuda_fingerprint_floor(t.device)
        return least is None or nbytes < least
    return False


def tensor_bytes(sd: Any) -> int:
    if isinstance(sd, torch.Tensor):
        if stageable(sd):  # a wrapper subclass: the bytes of its inner tensors (save/wrappers.py)
            return sum(map(tensor_bytes, inner_tensors(sd)))
        local = sd.to_local() if hasattr(sd, "to_local") else sd
        return int(local.numel() * local.element_size())
    if isinstance(sd, dict):
        return sum(tensor_bytes(v) for v in sd.values())
    if isinstance(sd, (list, tuple)):
        return sum(tensor_bytes(v) for v in sd)
    return 0


@contextmanager
def staging_failed(call: SaveCall, rank: int) -> Iterator[None]:
    """An async save whose staging failed (a tensor that cannot be copied, such as one on ``meta``; no
    memory for the buffers) raises the SaveError a sync save of that state raises, one line naming the
    cause, instead of the raw exception out of the copy: the caller's ``except SaveError`` is the same for
    both modes. Nothing was submitted, so nothing is committed. The ``save_failed`` event is ``call``'s."""
    try:
        with call.failing(SaveError):
            yield
    except SaveError:
        raise
    except Exception as e:
        raise SaveError.not_committed(call.step, f"rank {rank}: {describe_exception(e)}") from e


class Stager:
    """Holds one set of host buffers; ``stage`` returns a consistent snapshot living in them.

    The snapshot is valid until the next ``stage`` call: the caller keeps at most one save in flight.
    """

    def __init__(
        self,
        *,
        shared: bool = False,
        before_alloc: Callable[[], None] | None = None,
        share_from: Callable[[int, int], bool] | None = None,
    ) -> None:
        self._buffers: dict[str, Any] | None = None
        self._plan: Plan | None = None  # the buffers' pairing with the state they were made for
        self.allocations = 0
        # shared: the buffers live in one shared-memory segment that a writer process maps (see
        # shared_buffers.py); ``arena`` is the segment of the current buffer set.
        self._shared = shared
        # Asked before each new buffer set while not ``shared``, with the state's tensor items and bytes:
        # True makes this set and every later one shared (async_writer="auto": save/writer_choice.py).
        self._share_from = share_from
        self.arena: SharedArena | None = None
        # Called after the old buffers are dropped, before new ones are allocated: the writer process
        # unmaps its view of the old segment, so two sets never exist at once.
        self._before_alloc = before_alloc
        self._stream: torch.cuda.Stream | None = None  # the side stream of the device-to-host copy (CUDA)
        self.nbytes = 0
        """Tensor bytes of the current buffer set (what each ``stage`` copies), counted once per set."""
        self.fingerprints: dict[Alias, bytes | None] = {}
        """Of the last ``stage``: the fingerprint of each buffer whose bytes it proved (the writer's
        incremental layer uses them instead of hashing the staged copy again: store/incremental.py), None
        for a buffer copied because the tensor's version counter moved (written, not hashed)."""
        self.skipped = 0
        """Bytes the last ``stage`` did not copy: tensors proven unchanged since the buffers got them."""
        self._small: Split | None = None  # ``_split``'s, of one plan and policy
        # The segment the buffers lie in where small device tensors are gathered (save/gather.py): the
        # writer process's ``arena``, or one of this stager's own for the thread writer.
        self._region: SharedArena | None = None
        self.gathered = 0
        """Tensors the last ``stage`` copied through the gathered path (save/gather.py)."""

    def stage(
        self, sd: dict[str, Any], call: SaveCall | None = None, rank: int = 0, spent: list[Any] | None = None
    ) -> dict[str, Any]:
        """The snapshot of ``sd`` in the buffers. With ``call`` (the manager's save), a failure raises the
        SaveError a sync save raises (``staging_failed``). ``spent``: the walk is appended to it, for the
        caller to free off the loop (``BackgroundWriter.submit``)."""
        if call is None:
            return self._stage(sd, spent)
        with staging_failed(call, rank):
            return self._stage(sd, spent)

    def _stage(self, sd: dict[str, Any], spent: list[Any] | None = None) -> dict[str, Any]:
        # One walk: the snapshot in the current buffers, and the signature that says whether they still
        # fit (stage_plan.py); a state whose dicts only list their keys in another order is paired with the
        # same buffers by key; one that changed shape gets new buffers. Either is walked again.
        plan = self._plan
        walked = walk(sd, plan.slots if plan is not None else None)
        if plan is None or not (plan.fits(walked) or plan.refit(walked)):
            walked.snapshot = None  # paired by position: wrong now
            plan = plan.rekeyed(walked) if plan is not None else None
            if plan is not None and (plan.fits(walked) or plan.refit(walked)):
                self._plan = plan
            else:
                # The old plans hold the old buffers: let go of them first, so the old set is freed before
                # the new one is allocated (pinned memory is resident once allocated).
                plan = None
                plan = self._allocate(sd, walked)
            walked = walk(sd, plan.slots)
        snapshot: dict[str, Any] = walked.snapshot
        try:
            if len(plan.devices) != 1:
                self._copy(plan, walked)
                if plan.devices:
                    torch.cuda.synchronize()  # non_blocking D2H copies must land before the writer reads
            else:
                self._copy_on_side_stream(plan, walked, next(iter(plan.devices)))
        except BaseException:
            plan.forget()  # a copy that failed part-way: what the buffers hold is not known any more
            raise
        if spent is not None:
            # Its ~50,000 objects at 9,000 tensors (the signature's tuples, sizes, strides, devices) cost
            # ~2 ms to free: the caller frees them on the writer thread, not inside the loop's wait.
            spent.append(walked)
        return snapshot

    def _allocate(self, sd: dict[str, Any], walked: Walked) -> Plan:
        """A new buffer set for ``sd`` (the old one dropped first: never two sets alive at once)."""
        if self._buffers is not None:
            log.info("safepoint: state changed shape; reallocating staging buffers")
        self.release()
        if not self._shared and self._share_from is not None:
            self._shared = self._share_from(len(walked.leaves), tensor_bytes(sd))
        if self._before_alloc is not None:
            self._before_alloc()
        pin = bool(cuda_devices(walked))
        picks = gather_picks(walked, copied_unproven)
        # In a segment (shared, or gathered): untouched pages, re-homed below without a copy.
        laid = self._shared or bool(picks)
        form = staged_form(sd)  # a value pickled whole gets a buffer per storage (save/pickled.py)
        buffers = own_copies(form, cpu_buffers(form, pin_memory=pin and not laid))
        tie_buffers(form, buffers)
        mine: Walked | None = None  # the buffers' walk, paired with ``walked`` by position (Plan's too)
        if laid:
            mine = walk(buffers, None)
            try:
                self._region = move_into_arena(buffers, pin=pin, first=[mine.leaves[i] for i in picks])
            except (OSError, RuntimeError) as e:
                if self._shared:
                    raise  # the writer process reads the segment: no save without one
                # The gather only makes staging faster, and the thread writer needs no segment: fresh
                # buffers of torch's own, pinned, as without a gather.
                log.warning("safepoint: staging tensor by tensor: no staging segment (%s)", e)
                buffers = own_copies(form, cpu_buffers(form, pin_memory=pin))
                tie_buffers(form, buffers)
                mine = None
            if self._shared:
                self.arena = self._region
        self._buffers = buffers
        self.allocations += 1
        self.nbytes = tensor_bytes(buffers)
        self._plan = Plan(walked, buffers, mine)  # after the arena move: the buffers' final memory
        return self._plan

    def _copy_on_side_stream(self, plan: Plan, walked: Walked, device: torch.device) -> None:
        """The device-to-host copy on a stream of its own, synchronised alone.

        The side stream first waits for the work queued so far on the training's current stream, so the
        copy sees every update the loop issued before ``save`` (stream order, not a device-wide barrier).
        Only that stream is then synchronised: work other streams queued (a prefetch, NCCL) does not
        lengthen the block, as a ``torch.cuda.synchronize()`` would make it. The copies go into pinned
        buffers, so they are DMA transfers that need no staging copy of their own. The source
        tensors stay referenced by ``walked`` until the stream is synchronised, so the caching allocator
        cannot hand their memory to the loop while the copy still reads it.
        """
        with torch.cuda.device(device):
            if self._stream is None or self._stream.device != device:
                self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            self._stream.wait_stream(torch.cuda.current_stream(device))
            try:
                with torch.cuda.stream(self._stream):
                    # The fingerprints of the incremental check run here too, after the loop's queued work.
                    self._copy(plan, walked)
            finally:
                # A copy that failed part way too: the transfers it queued have run before the caller may
                # release the buffers (the segment unpinned and unmapped under a DMA still to write it).
                self._stream.synchronize()

    def _copy(self, plan: Plan, walked: Walked) -> None:
        """Copy the walked tensors into their buffers, except the plain tensors proven unchanged since their
        buffer got their bytes: the version counter is a hint in one direction only (moved: copied, no
        fingerprint); "unchanged" needs the fingerprint, computed where the tensor lives (GPU tensors on the
        GPU, so an unchanged one costs no device-to-host copy). A tensor too small for its fingerprint to
        cost less than its copy (``copied_unproven``) is copied without one, and the writer fingerprints the
        staged copy. A tied tensor (one buffer, two keys) is copied once. The copies go in one
        ``torch._foreach_copy_`` (one call, not one per tensor)."""
        lives, targets = plan.lives(walked), plan.targets
        self.gathered = 0
        # The memory of each tensor is fixed by the plan's signature: its version counter says the rest.
        try:
            versions: list[int | None] = [t._version for t in lives]
        except RuntimeError:  # an inference tensor has no version counter (fingerprinted every time)
            versions = [version_counter(t) for t in lives]
        seen, plan.versions = plan.versions, versions
        still, plan.still = plan.still, set()
        self.skipped = 0
        if seen is not None and not still and None not in seen and all(map(operator.ne, versions, seen)):
            # Every tensor written to since the last staging (a training step): all copied, none hashed,
            # as the lines below would decide one by one.
            plan.held = [None] * len(lives)
            self.fingerprints = plan.unhashed.copy()  # the hashes of its keys computed once per plan
            self._copy_every(plan, lives)
            _copy_opaque(plan, walked)
            return
        split = self._split(plan, lives)
        small, large = split.small, split.large
        # Written to since the last staging: copied, not fingerprinted, except a tensor that staging proved
        # unchanged and that has just been written: fingerprinted anyway, so that with its new fingerprint
        # recorded the next save can prove it unchanged again (store/incremental.py) instead of writing it
        # a second time unhashed. One that changes at every save is not (it would only say "changed").
        if seen is None:
            moved: list[int] = []
        elif not still and None not in seen:  # the same list, picked in C (no Python work per tensor)
            moved = list(compress(range(len(lives)), map(operator.ne, versions, seen)))
        else:
            moved = [i for i, v, s in zip(range(len(lives)), versions, seen, strict=True)
                     if s is not None and s != v and i not in still]  # fmt: skip
        was = plan.held
        held: list[bytes | None] = [None] * len(lives)
        plan.held = held  # None: the buffer's bytes are not proven (copied unhashed)
        # None: its counter moved, so it may have changed: the writer writes it without hashing it (a sync
        # save does the same with the live tensor; "unchanged" is never decided without a fingerprint).
        self.fingerprints = dict.fromkeys(map(plan.aliases.__getitem__, moved))
        if not large:
            # Every tensor is copied, written to or not (each too small to fingerprint here): the lists as
            # they are, not picked index by index (a model's frozen part made of small tensors; on a GPU,
            # every tensor under FINGERPRINT_CUDA_MIN_BYTES).
            self._copy_every(plan, lives)
            _copy_opaque(plan, walked)
            return
        written = set(moved)
        # Small tensors not written to: copied, the writer fingerprints the host copy, off the loop.
        todo = moved + [i for i in small if i not in written]
        if split.gather is not None:  # those it copies (all small ones: copied whatever their counter)
            split.gather.copy(lives)
            self.gathered = len(split.gather.members)
            todo = [i for i in todo if i not in split.gather.members]
        check = [i for i in large if i not in written]
        for i, fp in zip(check, fingerprints([lives[i].detach() for i in check]), strict=True):
            held[i] = fp
            if fp is None:
                todo.append(i)
                continue
            # The buffer holds exactly the bytes this fingerprint proved (copied below, or already there):
            # the writer uses it rather than hashing the staged copy again.
            self.fingerprints[plan.aliases[i]] = fp
            if was[i] == fp:
                self.skipped += plan.nbytes[i]
                plan.still.add(i)
            else:
                todo.append(i)
        _copy_all([targets[i] for i in todo], [lives[i] for i in todo])
        _copy_opaque(plan, walked)

    def _copy_every(self, plan: Plan, lives: list[torch.Tensor]) -> None:
        """Copy every target: the gathered ones through their chunks, the others in one batched call."""
        split = self._split(plan, lives)
        if split.gather is None:
            _copy_all(plan.targets, lives)
            return
        split.gather.copy(lives)
        self.gathered = len(split.gather.members)
        _copy_all(split.other_targets, list(map(lives.__getitem__, split.others)))

    def _split(self, plan: Plan, lives: list[torch.Tensor]) -> Split:
        """The targets copied whatever their version counter says (``copied_unproven``) and the others, in
        order, and the gather of the small device ones; fixed by the plan's signature (device and size of
        each target) and the policy, so computed once per plan and policy, not per save."""
        key = (
            FINGERPRINT_CPU_MIN_BYTES,
            tuple((d, cuda_fingerprint_floor(d)) for d in sorted(plan.devices, key=str)),
        )
        was, self._small = self._small, None
        if was is not None and was.plan is plan and was.key == key:
            self._small = was
            return was
        small: list[int] = []
        large: list[int] = []
        for i, t in enumerate(lives):
            (small if copied_unproven(t, plan.nbytes[i]) else large).append(i)
        # Gathered on one device only (the side stream's); a state across devices copies tensor by tensor.
        picks = [i for i in small if gatherable(lives[i], plan.nbytes[i])]
        one_device = len({lives[i].device for i in picks}) == 1 and len(plan.devices) <= 1
        gather, build = None, one_device
        if one_device and was is not None and was.key == key:
            # A plan re-paired by key (Plan.rekeyed): the same buffers, so the same gather, re-paired too
            # (built anew it is Python work per tensor at every reordered save), or none where it had none:
            # a device without room for its buffer is asked once per buffer set (on CUDA each failed try
            # first frees every cached block of the allocator, and warns).
            gather = was.gather.rekeyed(was.plan.targets, plan.targets) if was.gather is not None else None
            build = was.gather is not None and gather is None
        was = None  # its gather's device buffer goes before the next one is made
        if build:
            gather = plan_gather(plan.targets, lives, picks, self._region)
        self._small = Split(plan, key, small, large, gather)
        return self._small

    def release(self) -> None:
        self._plan = None  # its incremental records go with the buffers they describe
        self._small = None  # it holds the plan, and so the buffers
        self._buffers = None
        self.nbytes = 0
        if self._region is not None and self._region is not self.arena:
            self._region.release()
        self._region = None
        if self.arena is not None:
            self.arena.release()  # the memory goes with the last tensor that maps it
            self.arena = None


def _copy_all(targets: list[torch.Tensor], lives: list[torch.Tensor]) -> None:
    """``targets[i].copy_(lives[i])`` for every i, in one call. non_blocking: a CUDA source is copied on
    the current stream, which the caller synchronises before the writer reads the buffers."""
    if targets:
        with torch.no_grad():  # a Parameter source must not make the buffer part of its autograd graph
            torch._foreach_copy_(targets, lives, non_blocking=True)


def _copy_opaque(plan: Plan, walked: Walked) -> None:
    """The tensor items the batched copy does not take (a wrapper subclass's inner tensors, a ShardedTensor's
    shards): save/wrappers.py ``copy_opaque``."""
    copy_opaque([(buf, walked.leaves[i]) for i, buf in plan.opaque])
