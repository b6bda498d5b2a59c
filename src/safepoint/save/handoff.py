"""What an async save hands its writer process: where every item lies once, then only what changed.

A save's items are of two kinds. Most tensors lie in the staging segment that the process has mapped: the
process needs DCP's plan and, per item, the item's place there (offset, dtype, shape, strides). The others
travel by value: byte items (optimizer hyperparameters, scheduler and extra state, pickled by DCP) and the
tensors outside the segment (0-d ones such as Adam's ``step``). Values change on every save; the plan and
the places do not while the state keeps its structure (DCP's plan caching hands back the very same plan
object, and the staging buffers are reused). Describing all of it on every save cost a 5,000-tensor state
about twice a sync save's CPU (benchmarks/README.md, issue 16): pickling the plan and a tuple per item in the
rank, unpickling them and rebuilding every tensor view in the process. So the process keeps the last
description it was sent (``Held``), and a save whose plan, places and segment equal the rank's record of it
(``Sent``) sends a key and the values only. Anything else (a changed state, a new segment, a new process
after a crash) sends the full description again; a process asked for a description it does not hold
answers "stale" and the rank sends it in full.

0-d and other small plain tensors travel as raw bytes with their dtype and shape: pickling a tensor goes
through ``torch.save`` per tensor (~0.1 ms each, 1,250 of them in that state). A wrapper tensor subclass
(torchao's NF4: save/wrappers.py) travels as its class, context and attributes with the places of its inner
tensors in the segment: a few hundred bytes per save, never its data.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from safepoint.save.shared_buffers import SharedArena
from safepoint.save.wrappers import flatten, stageable, unflatten, with_state

log = logging.getLogger("safepoint")

# A tensor outside the staging segment bigger than this is worth a warning: it means a copy per save.
_BY_VALUE_WARN = 1024 * 1024

Place = tuple[Any, ...] | None
"""Where an item lies in the staging segment: ("arena", offset, nbytes, dtype, storage_offset, size,
stride); None for an item sent by value."""

Arranged = list[tuple[str, list[int]]]
"""An incremental save's files for the writer process: (file name, positions of its items in the plan)."""


class HandoffError(OSError):
    """An item the writer process cannot be handed (neither in the segment nor a tensor or bytes)."""


def place_of(data: Any, arena: SharedArena | None) -> Place:
    if isinstance(data, torch.Tensor) and arena is not None and data.device.type == "cpu":
        if stageable(data):
            return None  # a wrapper subclass has no bytes of its own (its inner tensors do: value_of)
        st = data.untyped_storage()
        off = arena.offset_of(st.data_ptr(), st.nbytes())
        if off is not None:
            size, stride = tuple(data.size()), data.stride()
            return ("arena", off, st.nbytes(), data.dtype, data.storage_offset(), size, stride)
    return None


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def value_of(data: Any, arena: SharedArena | None = None) -> tuple[Any, ...]:
    """An item sent by value: ("bytes", b), ("raw", dtype, size, b), ("tensor", t) or ("wrapper", ...)."""
    if stageable(data):
        return _wrapper_value(data, arena)
    if isinstance(data, io.BytesIO):
        return ("bytes", data.getvalue())
    if not isinstance(data, torch.Tensor):
        raise HandoffError(f"cannot hand a {type(data).__name__} item to the writer process")
    t = data.detach()
    size = tuple(t.size())
    nbytes = t.numel() * t.element_size()
    if (
        type(t) is torch.Tensor
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.is_quantized
        and t.storage_offset() == 0
        and t.stride() == _contiguous_strides(size)
        and t.untyped_storage().nbytes() == nbytes
    ):
        # Exactly its own bytes, laid out as torch.empty would: what the process rebuilds is what
        # torch.save (DCP's record format) sees, storage and all.
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if nbytes else b""
        return ("raw", t.dtype, size, raw)
    if nbytes > _BY_VALUE_WARN:
        log.warning("safepoint: a %d-byte tensor is outside the staging segment: copied per save", nbytes)
    return ("tensor", t.cpu())  # the process has no CUDA (a 0-d DTensor's local tensor stays on device)


def _wrapper_value(t: torch.Tensor, arena: SharedArena | None) -> tuple[Any, ...]:
    """A wrapper subclass (save/wrappers.py) as the process rebuilds it: its type, flatten context, size,
    strides and ``requires_grad``, its ``__dict__`` but for the inner tensors (None in their place), and per
    inner tensor its place in the segment, or its value (a nested wrapper, a tensor outside the segment).
    Sent every save, but only its metadata: the bytes stay in the segment (the staged snapshot's inner
    tensors, as every plain buffer)."""
    names, ctx = flatten(t)
    inner = []
    for name in names:
        x = getattr(t, name)
        place = place_of(x, arena)
        inner.append((name, place, value_of(x, arena) if place is None else None))
    state = [(k, None if k in names else v) for k, v in t.__dict__.items()]
    return ("wrapper", type(t), ctx, tuple(t.size()), t.stride(), t.requires_grad, state, inner)


def _rebuilt(value: tuple[Any, ...], arena: SharedArena | None) -> torch.Tensor:
    """The wrapper that ``_wrapper_value`` describes, over the segment's memory."""
    _, kind, ctx, size, stride, requires_grad, state, parts = value
    inner = {
        name: _materialize_place(place, arena) if place is not None else materialize_value(v, arena)
        for name, place, v in parts
    }
    out = with_state(unflatten(kind, inner, ctx, size, stride), set(inner), state)
    return out.requires_grad_() if requires_grad else out


def describe(
    plan: SavePlan, planner: SavePlanner, arena: SharedArena | None
) -> tuple[list[Place], list[Any]]:
    """Per item of ``plan`` (in its order) its place, and the values of the items that have none."""
    places: list[Place] = []
    values: list[Any] = []
    for item in plan.items:
        data = planner.resolve_data(item)
        place = place_of(data, arena)
        places.append(place)
        if place is None:
            values.append(value_of(data, arena))
    return places, values


class Describer:
    """``describe`` for one manager's saves, the places of the last plan remembered.

    Why: ``describe`` resolves every item through DCP's planner and reads each tensor's storage, ~14 us an
    item: 160 ms of the rank's CPU per save of 9,000 tensors + Adam's 3,000 steps (docs/benchmarks.md,
    "Process writer at 9,000 tensors, CPU"), in the rank's background thread, holding the GIL the training
    loop needs. A steady save's places are those of the last save: they are a function of the plan's items
    and of which staging buffer each resolves to, and both are fixed while
    - the plan is the very object last described: DCP's plan cache hands back its cached plan only for a
      local plan equal to it, and safepoint's planner only where the flattened keys, their paths and each
      item's kind are those of the cached plan (plan_reuse.py), so every key resolves to the same path of
      the staged snapshot; and
    - the staging segment is the same: every new buffer set is a new segment (``move_into_arena``), and
      while it lives the stager keeps each key path on its buffer (``Plan.fits``/``refit``/``rekeyed``).
    So only the items sent by value are resolved again (their values change every save). A by-value item
    that now lies in the segment (which the two conditions exclude) makes the description start over.
    """

    def __init__(self) -> None:
        self._plan: SavePlan | None = None  # held: its id() cannot be reused while it is remembered
        self._arena_id: str | None = None
        self._places: list[Place] = []
        self._by_value: list[int] = []  # positions in the plan of the items sent by value
        self._positions: dict[int, int] | None = None  # id(item) -> its position in the plan
        self._checked: tuple[SavePlan, Arranged | None, list[WriteResult]] | None = None
        self.full = 0
        """Descriptions built item by item (the others reused the last one's places)."""

    def describe(
        self, plan: SavePlan, planner: SavePlanner, arena: SharedArena | None
    ) -> tuple[list[Place], list[Any]]:
        """``describe(plan, planner, arena)``: the same places and values, computed per item only for a
        plan or segment not described last time."""
        arena_id = arena.id if arena is not None else None
        if plan is self._plan and arena_id == self._arena_id:
            values = []
            for i in self._by_value:
                data = planner.resolve_data(plan.items[i])
                if place_of(data, arena) is not None:
                    break  # not what was described: describe it anew
                values.append(value_of(data, arena))
            else:
                return self._places, values
        self._plan = None  # until the new description is complete
        places, values = describe(plan, planner, arena)
        self.full += 1
        self._places, self._arena_id, self._positions = places, arena_id, None
        self._by_value = [i for i, place in enumerate(places) if place is None]
        self._plan = plan
        return places, values

    def checked_before(self, plan: SavePlan, files: Arranged | None, results: list[WriteResult]) -> bool:
        """Whether ``results`` is the very list a save of ``plan`` with these ``files`` got and checked
        before: the writer process answered "same as last time" (Sent.results), so the items it answered
        for are those already checked against what was asked (two sets of every item's index, ~30 ms at
        12,000 items, not built again)."""
        last = self._checked
        return last is not None and results is last[2] and plan is last[0] and files == last[1]

    def check_passed(self, plan: SavePlan, files: Arranged | None, results: list[WriteResult]) -> None:
        """``results`` answered for exactly the items ``plan`` and ``files`` asked for."""
        self._checked = (plan, files, results)

    def positions(self, plan: SavePlan, items: list[Any]) -> list[int]:
        """The position in ``plan`` of each of ``items`` (items of ``plan``: the very objects, or equal
        ones, found by their index)."""
        if plan is self._plan:
            # By identity: the plan is held, so its items' ids are theirs alone (a dataclass's __hash__ of
            # each MetadataIndex is Python code: ~1 us an item).
            if self._positions is None:
                self._positions = {id(item): i for i, item in enumerate(plan.items)}
            by_id = self._positions
            found = [by_id.get(id(item)) for item in items]
            if None not in found:
                return found  # type: ignore[return-value]
        index = {item.index: i for i, item in enumerate(plan.items)}
        return [index[item.index] for item in items]


@dataclass(slots=True)
class Sent:
    """The rank's record of the description its writer process holds."""

    key: int
    plan: SavePlan
    places: list[Place]
    arena_id: str | None
    results: list[WriteResult] | None = None
    """The write results of the last save written from it (what a "same" answer stands for)."""

    def matches(self, plan: SavePlan, places: list[Place], arena_id: str | None) -> bool:
        # The plan object itself is what DCP's cache hands back for an unchanged state; an equal one will
        # do too. The places decide the rest: the same items at the same offsets of the same segment.
        return (
            arena_id == self.arena_id
            and (plan is self.plan or plan == self.plan)
            and (places is self.places or places == self.places)  # the very list: Describer reused it
        )


def _materialize_place(place: tuple[Any, ...], arena: SharedArena | None) -> torch.Tensor:
    if place[0] != "arena":
        raise ValueError(f"unknown place {place[0]!r}")
    if arena is None:
        raise RuntimeError("an item refers to a staging segment this process was not given")
    _, start, nbytes, dtype, storage_offset, size, stride = place
    return torch.empty(0, dtype=dtype).set_(arena.storage(start, nbytes), storage_offset, size, stride)


def materialize_value(value: tuple[Any, ...], arena: SharedArena | None = None) -> Any:
    kind = value[0]
    if kind == "bytes":
        return io.BytesIO(value[1])
    if kind == "raw":
        _, dtype, size, raw = value
        if not raw:
            return torch.empty(size, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(size)
    if kind == "tensor":
        return value[1]
    if kind == "wrapper":
        return _rebuilt(value, arena)
    raise ValueError(f"unknown item kind {kind!r}")


@dataclass(slots=True)
class Held:
    """The writer process's copy of the last full description: the plan and a view of each placed item
    (views of the mapped segment: no memory of their own)."""

    key: int
    arena_id: str | None
    plan: SavePlan
    views: dict[MetadataIndex, torch.Tensor]
    by_value: list[MetadataIndex] = field(default_factory=list)
    results: list[WriteResult] | None = None
    """DCP's write results of the last save written from this description: a save that produces equal
    ones (the same item sizes at the same offsets) answers "same" and the rank reuses its copy."""

    @classmethod
    def build(cls, key: int, arena: SharedArena | None, plan: SavePlan, places: list[Place]) -> Held:
        if len(places) != len(plan.items):
            raise ValueError(f"{len(places)} places for {len(plan.items)} items")
        held = cls(key, arena.id if arena is not None else None, plan, {})
        for item, place in zip(plan.items, places, strict=True):
            if place is None:
                held.by_value.append(item.index)
            else:
                held.views[item.index] = _materialize_place(place, arena)
        return held

    def data(self, values: list[Any], arena: SharedArena | None = None) -> dict[MetadataIndex, Any]:
        """Every item's data for one save: the held views and this save's values (``arena``: the segment
        a wrapper subclass's inner tensors lie in)."""
        if len(values) != len(self.by_value):
            raise ValueError(f"{len(values)} values for {len(self.by_value)} items sent by value")
        data: dict[MetadataIndex, Any] = dict(self.views)
        for index, value in zip(self.by_value, values, strict=True):
            data[index] = materialize_value(value, arena)
        return data
