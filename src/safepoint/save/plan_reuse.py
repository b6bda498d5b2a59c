"""DCP's save planner, minus the rebuilding of an unchanged local plan.

With plan caching on, DCP still builds every save's local plan afresh (one ``WriteItem`` with its index,
chunk and tensor properties per item: 40,000 for 10,000 parameters with Adam) and then compares it with
the cached one item by item, only to send "unchanged" to the coordinator: 27-35% of a steady save of many
small tensors (issue 27). Here the plan DCP would build is proven equal to the cached one without building
it, from what it is a function of:

- the flattened keys, in order, and the path of each in the nested state dict (``planner_data``);
- per item, whether it is a tensor and, for a tensor of exactly ``torch.Tensor`` (nothing sharded, no
  subclass), its dtype, shape, layout, ``requires_grad`` and ``is_pinned()``: ``WriteItem`` holds these
  and nothing else of it (``_create_write_item_for_tensor``; ``memory_format`` is a constant there).

Any other value (a DTensor, a ShardedTensor, a subclass) makes the structure unprovable here and DCP plans
as before. When it matches, the answer is exactly DCP's own for an unchanged plan (an empty plan marked
unusable; the cached final plan is used), so the files written are the same. The record holds the keys
and one shared tuple per distinct tensor kind, and is replaced only once DCP promoted the new local plan
to its cache (after the global plan succeeded), so the two never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from safepoint.store.flatten_order import set_up_sharded_last

_BYTES = ("bytes",)  # the kind of a non-tensor item (a BYTE_IO WriteItem: its key is all there is)


@dataclass(frozen=True, slots=True)
class Structure:
    """What a local save plan is a function of (see the module docstring)."""

    keys: tuple[str, ...]
    kinds: tuple[tuple[Any, ...], ...]
    paths: dict[str, Any]
    coordinator: bool


class PlanRecord:
    """The structure of the local plan in DCP's cache under one saver's key (held by the saver)."""

    def __init__(self) -> None:
        self.structure: Structure | None = None
        self.byte_items: dict[str, tuple[bytes, bytes]] = {}
        """{key: (pickle of its value, torch.save bytes)} of the non-tensor items last written: an item
        whose value pickles alike is not serialised again (store/item_writer.py ``byte_item``)."""


def structure_of(state_dict: dict[str, Any], paths: dict[str, Any], coordinator: bool) -> Structure | None:
    """The structure of a flattened state dict, or None if some value is not a plain tensor or a value."""
    interned: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    kinds: list[tuple[Any, ...]] = []
    for value in state_dict.values():
        if not isinstance(value, torch.Tensor):
            kinds.append(_BYTES)
            continue
        if type(value) is not torch.Tensor:
            return None
        kind = (value.dtype, value.shape, value.layout, value.requires_grad, value.is_pinned())
        kinds.append(interned.setdefault(kind, kind))
    return Structure(tuple(state_dict), tuple(kinds), paths, coordinator)


class ReusingSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner(enable_plan_caching=True)`` under the saver's own cache key, which skips
    building the local plan when ``record`` proves it unchanged."""

    def __init__(self, cache_key: str, record: PlanRecord) -> None:
        super().__init__(enable_plan_caching=True)
        self._cached_plans_key = cache_key
        self._record = record
        self._structure: Structure | None = None
        self.byte_items = record.byte_items  # read by the item writer (store/item_writer.py)

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        # DCP's own signature, ``storage_meta`` named: dcp.save inspects it and, where that name is missing,
        # warns on every save and calls it positionally, (state_dict, is_coordinator), so a ``*args``
        # pass-through handed is_coordinator to storage_meta and False to is_coordinator on every rank.
        # The state flattened, then its ShardedTensors only where there is one (store/flatten_order.py).
        set_up_sharded_last(self, lambda: super(ReusingSavePlanner, self).set_up_planner(
            state_dict, storage_meta, is_coordinator))  # fmt: skip

    def create_local_plan(self) -> SavePlan:
        self._structure = structure_of(self.state_dict, self.mappings, self.is_coordinator)
        known = self._record.structure
        if (
            self._structure is not None
            and known is not None
            and self._cached_plans_key in SavePlanner._cached_save_plan
            and self._structure == known
        ):
            return SavePlan([], usable=False)  # what DCP answers for an unchanged local plan
        self._record.structure = None  # DCP's cached local plan may be replaced below
        plan = super().create_local_plan()
        if not plan.usable and _other_properties(
            self.plan, SavePlanner._cached_save_plan[self._cached_plans_key]
        ):
            # DCP compares items by index, size and chunk, not dtype: a tensor cast at the same shape (a
            # model to bfloat16, Adam's step to int64) kept the cached plan and its .metadata of the old
            # dtype, which verify then calls corrupt and export casts back. Without the stale entry DCP
            # plans it as the new plan it is (once more: rare, and what each DCP version does for one).
            del SavePlanner._cached_save_plan[self._cached_plans_key]
            plan = super().create_local_plan()
        if not plan.usable and self._structure is not None:
            # DCP found the plan it built equal to its cached one: that one is of this structure. (Its
            # key paths kept, not this save's equal copy: the record adds no memory of its own.)
            cached = SavePlanner._cached_save_plan[self._cached_plans_key]
            self._record.structure = replace(self._structure, paths=cached.planner_data)
        return plan

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        # One plan (one process, or a world of one): no item can be in two plans, and DCP's
        # dedup_save_plans hands the plan back with the very items it had, in the same order, after
        # hashing every item's index into two maps and two sets: ~0.3 s of a first save of 40,000 items
        # (~6 % of it; issue 27, round 11 of docs/benchmarks.md). Only a changed plan reaches here (the
        # first save, a new structure). What DCP returns for one plan, without that work:
        if len(all_plans) == 1:
            return [replace(all_plans[0], items=list(all_plans[0].items))]
        return super()._dedup_save_plans(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        had_pending = hasattr(self, "_pending_local_plan")
        plan = super().finish_plan(new_plan)
        if had_pending:  # DCP cached the local plan just built: it is of this structure
            self._record.structure = self._structure
        return plan


def _other_properties(plan: SavePlan, cached: SavePlan) -> bool:
    """Whether a local plan DCP found equal to its cached one (the same items in the same order) holds a
    tensor of other properties (dtype, layout, requires_grad, pin_memory) than the cached plan says."""
    return any(
        a.tensor_data is not None
        and b.tensor_data is not None
        and a.tensor_data.properties != b.tensor_data.properties
        for a, b in zip(plan.items, cached.items, strict=True)
    )
