"""The walk of a value DCP pickles whole (a tuple; a list with no tensor and no dict in it) for async saves.

DCP flattens a state's dicts and lists into one item per tensor, but a value its traversal calls terminal
(``torch.distributed.checkpoint._traverse``: a tuple, a list holding no tensor and no dict, at any depth of
lists) it stores as one ``torch.save`` of the value. A sync save hands it the live value, so what restore
gives back is what pickling keeps:
- container types (a dict's too, an OrderedDict's attributes), a tensor's class and ``requires_grad``;
- identity: an object met twice in the value is one object (a weight tied twice is one Parameter);
- a tensor's view: its strides, storage offset and its *whole* storage (bytes no view reads included), one
  storage for every view of it in the value, and the conj and neg bits.

The async snapshot must give back the same (issue: async fidelity). So this walk, unlike the flattening
one (save/stage_plan.py), stages *storages*: each storage met in the value is one tensor item of the walk,
its leaf the storage's bytes (a flat tensor over all of it, in the dtype of the tensor that met it), and
each tensor of the value is rebuilt in the snapshot as the same view of the buffer that holds those bytes.
An object met again is the snapshot's object of its first meeting. A wrapper subclass (save/wrappers.py) is
walked through its inner tensors as tensors of the value and rebuilt over their views at every save (its
own buffer set, packed, lost the views and the ties a pickle keeps: rev9c review). Its items in the
signature: the storage's leaf token for a tensor that first meets a storage, ``None`` for a tensor over
a storage met before, for an object met before and for a wrapper (what the buffers must fit is the
storages alone; the views and wrappers are rebuilt from the live state at every save).

A leaf is a view of the live tensor, so the incremental check (save/staging.py) reads its version counter
as for any tensor; where it has to be bytes of its own (a conj view), its counter never moves, and the
check fingerprints it when large and copies it when small: right either way (the counter is only ever a
hint that a tensor *changed*). The buffers are the leaves' own copies, and the walk of the buffers
(``walk(buffers, None)``, by ``Plan``) takes a buffer that is all of its storage as its own leaf, so
buffers re-homed in a shared segment stay paired.

Only values pickled whole pay for this: the walk of dicts and lists of tensors stays as it was.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from safepoint.save.kinds import (
    DICT,
    DTENSOR,
    LIST,
    PLAIN_TYPES,
    SCALARS,
    TUPLE,
    Walked,
    alias,
    as_pickled,
    opaque_token,
    plain,
    same_dict,
    same_kind,
)
from safepoint.save.wrappers import flatten, stageable, unflatten, with_state

_STRIDED = torch.strided
_UINT8 = torch.uint8


def terminal(v: Any) -> bool:
    """Whether DCP stores the list ``v`` as one pickled value: no tensor and no mapping in it, and every
    list in it such a list too (``_traverse.traverse_state_dict``'s ``_is_terminal``)."""
    for x in v:
        if isinstance(x, (torch.Tensor, Mapping)) or (isinstance(x, list) and not terminal(x)):
            return False
    return True


def whole_bytes(t: Any, st: torch.UntypedStorage) -> bool:
    """Whether ``t`` is a flat tensor over every byte of a storage of as many bytes as ``st`` (a staging
    buffer, or a live tensor that is all of its storage)."""
    return (
        type(t) is torch.Tensor
        and t.dim() == 1
        and t.storage_offset() == 0
        and t.is_contiguous()
        and t.numel() * t.element_size() == st.nbytes() == t.untyped_storage().nbytes()
        and not (t.is_conj() or t.is_neg())
    )


def _bytes_of(v: torch.Tensor, st: torch.UntypedStorage) -> torch.Tensor:
    """A flat tensor over every byte of ``v``'s storage ``st``, in ``v``'s dtype where it divides them: a
    view of ``v``, so it shares its version counter (a tensor written to since the last save is copied
    without a fingerprint, as in a dict: save/staging.py). As bytes where it cannot be one (a conj or neg
    view would be copied resolved; a storage that is no whole number of ``v``'s elements)."""
    size = v.element_size()
    if not (v.is_conj() or v.is_neg()) and st.nbytes() % size == 0:
        flat = v.detach() if v.requires_grad else v  # no autograd node for a view only read
        return flat.as_strided((st.nbytes() // size,), (1,), 0)
    return torch.empty(0, dtype=_UINT8, device=v.device).set_(st)


def view_of(live: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """``live``'s view (dtype, size, strides, offset, conj and neg bits) over the bytes of ``buf``; a
    Parameter or a tensor that requires grad as pickling keeps it (``as_pickled``)."""
    if buf.dtype is live.dtype:  # one call where the buffer is of its dtype (all but a dtype view)
        t = buf.as_strided(live.size(), live.stride(), live.storage_offset())
    else:
        t = torch.empty(0, dtype=live.dtype, device=buf.device)
        t.set_(buf.untyped_storage(), live.storage_offset(), live.size(), live.stride())
    if live.is_conj():
        t = t.conj()
    if live.is_neg():
        t = torch._neg_view(t)
    return as_pickled(live, t) if live.requires_grad or type(live) is not torch.Tensor else t


class Pickled:
    """One value pickled whole, walked into ``out`` (a ``Walked``): see the module docstring."""

    __slots__ = ("copies", "have", "memo", "out", "slots", "stores")

    def __init__(self, out: Walked, slots: Sequence[Any] | None, have: int) -> None:
        self.out, self.slots, self.have = out, slots, have
        self.memo: dict[int, Any] = {}  # id of an object of the value -> its snapshot (pickle's memo)
        self.stores: dict[int, Any] = {}  # a storage (its StorageImpl) -> what holds its bytes
        self.copies: dict[int, Any] = {}  # deepcopy's memo, one for the value: what it shares stays shared

    def visit(self, v: Any) -> Any:
        kind = type(v)
        if kind in SCALARS:
            self.out.tokens.append(None)
            return v
        got = self.memo.get(id(v), self.memo)
        if got is not self.memo:
            self.out.tokens.append(None)  # the object met before: one object in the pickle too
            return got
        new = self._visit(v, kind)
        self.memo[id(v)] = new
        return new

    def _visit(self, v: Any, kind: type) -> Any:
        out = self.out
        append = out.tokens.append
        if isinstance(v, dict):
            append((DICT, *v))
            items = {k: self.visit(x) for k, x in v.items()}
            return items if kind is dict else same_dict(v, items)
        if isinstance(v, (list, tuple)):
            append((TUPLE if isinstance(v, tuple) else LIST, len(v)))
            seq = [self.visit(x) for x in v]
            return seq if kind is list else tuple(seq) if kind is tuple else same_kind(kind, seq)
        i = len(out.leaves)
        if kind in PLAIN_TYPES and v.layout is _STRIDED:
            st = v.untyped_storage()
            key = st._cdata
            if key in self.stores:
                append(None)  # a view of a storage met before: its buffer is that storage's
            else:
                leaf = v if whole_bytes(v, st) else _bytes_of(v, st)
                append((leaf.device, leaf.data_ptr(), leaf.dtype, leaf.shape, leaf.stride()))
                out.leaves.append(leaf)
                slot = self.slots[i] if i < self.have else None  # type: ignore[index]
                # A slot of another size (a plan this walk will not fit: its snapshot is dropped and the
                # walk redone) is not built on: a view may not fit in it, and a storage would be resized.
                if type(slot) is not torch.Tensor or slot.untyped_storage().nbytes() != st.nbytes():
                    slot = None
                self.stores[key] = slot
            buf = self.stores[key]
            return v if buf is None else view_of(v, buf)
        if stageable(v):
            append(None)  # what the buffers must fit is its inner tensors' storages, met below
            return self._wrapper(v)
        if isinstance(v, DTensor) and plain(local := v._local_tensor):
            append((DTENSOR, v.device_mesh, tuple(v.placements), v.shape, v.stride(), alias(local)))
            out.leaves.append(local)
            out.wrapped[i] = v
        elif isinstance(v, torch.Tensor):
            append(opaque_token(v))
            out.leaves.append(v)
            out.opaque.append(i)
        else:
            append(None)
            return copy.deepcopy(v, self.copies)  # its own copy, as the flattening walk makes
        return self.slots[i] if i < self.have else v  # type: ignore[index]

    def _wrapper(self, v: Any) -> Any:
        """A wrapper subclass (save/wrappers.py) as a pickle keeps it: each inner tensor walked as any tensor
        of the value (the same view of its storage's buffer, one storage with the value's other views of
        it), the wrapper rebuilt over them with copies of its context and other attributes."""
        names, ctx = flatten(v)
        inner = {name: self.visit(getattr(v, name)) for name in names}
        if names and all(inner[name] is getattr(v, name) for name in names):
            return v  # no buffers yet: a walk to be redone
        out = unflatten(type(v), inner, copy.deepcopy(ctx, self.copies), v.size(), v.stride())
        if v.requires_grad:
            out.requires_grad_()
        keys = set(names)
        state = [(k, None if k in keys else copy.deepcopy(x, self.copies)) for k, x in v.__dict__.items()]
        return with_state(out, keys, state)
