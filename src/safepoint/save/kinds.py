"""The kinds of item an async save's walk meets (save/stage_plan.py, save/pickled.py), and the container
types of its snapshot (the walk copies every container).

A tuple or list subclass keeps its type (a ``torch.Size``, a namedtuple: a sync save writes it so, and
restore loads it so). A dict becomes a plain dict, since DCP stores a dict's keys, never its type, except
inside a tuple, which DCP stores as one pickled value, container types and all; there a tensor's class and
``requires_grad`` are pickled with it too (``as_pickled``)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from safepoint.data.restorable import refilled
from safepoint.save import wrappers

PLAIN_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
SCALARS = frozenset({int, float, str, bytes, bool, type(None)})
# Tags of the signature's items that are not a tensor's: distinct objects, compared by identity.
DICT, LIST, TUPLE, DTENSOR, OPAQUE = (object() for _ in range(5))


def plain(t: Any) -> bool:
    """A tensor staged by the batched copy: a plain strided Tensor or Parameter (not a subclass)."""
    return type(t) in PLAIN_TYPES and t.layout is torch.strided


def alias(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors the very same values: (device, data_ptr, dtype, shape, strides, conj, neg).
    The conj and neg bits too: ``z.conj()`` is the same memory, dtype and view as ``z`` but other values."""
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.is_conj(), t.is_neg())


def opaque_token(v: torch.Tensor) -> tuple[Any, ...]:
    """The structure of a tensor item the batched copy does not take: a ShardedTensor's local shards (offset,
    shape, dtype, device each), a wrapper subclass's ``wrappers.token``, else kind, dtype, shape, device."""
    shards = getattr(v, "local_shards", None)
    if callable(shards):  # a ShardedTensor: its buffer holds the same local shards
        parts = tuple((tuple(s.metadata.shard_offsets), alias(s.tensor)) for s in shards())
        return (OPAQUE, type(v), tuple(v.size()), parts)
    return (OPAQUE, *(wrappers.token(v) or (type(v), v.layout, v.device, v.dtype, tuple(v.shape))))


def same_dict(v: dict[Any, Any], items: dict[Any, Any]) -> dict[Any, Any]:
    """``items`` (the copied entries of the dict subclass ``v``) in a dict of ``v``'s type: a shallow copy
    of ``v`` emptied and refilled, so what its constructor needs (a defaultdict's factory) comes with it,
    and its attributes copied deep (pickled with it, as a state dict's ``_metadata``: no later write to
    the live ones may reach the snapshot). A type that cannot be copied so stays the plain dict it was."""
    try:
        out = refilled(v, items)
        state = getattr(v, "__dict__", None)
        if state:
            out.__dict__ = copy.deepcopy(state)
    except Exception:
        return items
    return out


def same_kind(kind: Any, items: Any) -> Any:
    """``items`` (the copied entries of a list or tuple subclass ``kind``) as that type: a ``torch.Size`` or
    a namedtuple stays what the state held (a sync save writes it so, and restore loads it so); a type that
    cannot be built from its entries stays the plain list or tuple the copy was."""
    try:
        return kind._make(items) if isinstance(items, list) and hasattr(kind, "_make") else kind(items)
    except Exception:
        return tuple(items) if issubclass(kind, tuple) else items


def as_pickled(live: torch.Tensor, staged: torch.Tensor) -> torch.Tensor:
    """The snapshot's ``staged`` copy of the plain tensor ``live`` inside a tuple (pickled whole, a tensor's
    class and ``requires_grad`` with it): a Parameter stays one, the flag is kept, as a sync save pickles
    them (an object that sets a restored Parameter back on a module needs one). Over the same memory."""
    if type(live) is torch.nn.Parameter:
        return torch.nn.Parameter(staged, requires_grad=live.requires_grad)
    return staged.detach().requires_grad_() if live.requires_grad else staged


class Walked:
    """One walk of a state: its snapshot, its signature, and the tensors to copy, in order."""

    __slots__ = ("leaves", "opaque", "snapshot", "tokens", "wrapped")

    def __init__(self) -> None:
        self.tokens: list[Any] = []
        """The signature (see the module docstring)."""
        self.leaves: list[Any] = []
        """Per tensor item, in walk order: what its copy reads or writes (the plain tensor, a DTensor's
        local tensor) or, for an ``opaque`` one, the item itself."""
        self.wrapped: dict[int, Any] = {}
        """The DTensor items, by position (``leaves`` holds their local tensors)."""
        self.opaque: list[int] = []
        """Positions of the tensor items that are neither plain nor a DTensor over a plain local tensor
        (a ShardedTensor, a wrapper subclass, a sparse tensor): copied by save/wrappers.py ``copy_opaque``."""
        self.snapshot: Any = None

    def items(self) -> list[Any]:
        """Per tensor item: the item itself (a DTensor where ``leaves`` has its local tensor)."""
        return [self.wrapped.get(i, t) for i, t in enumerate(self.leaves)] if self.wrapped else self.leaves
