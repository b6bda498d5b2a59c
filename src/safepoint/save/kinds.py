"""The container types of an async save's snapshot (save/stage_plan.py's walk copies every container).

A tuple or list subclass keeps its type (a ``torch.Size``, a namedtuple: a sync save writes it so, and
restore loads it so). A dict becomes a plain dict, since DCP stores a dict's keys, never its type, except
inside a tuple, which DCP stores as one pickled value, container types and all; there a tensor's class and
``requires_grad`` are pickled with it too (``as_pickled``)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from safepoint.data.restorable import refilled


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


def pickled_apart(x: Any) -> bool:
    """A plain strided tensor that a pickle tells apart from a plain tensor's copy: a Parameter, or one
    that requires grad."""
    return (
        type(x) in (torch.Tensor, torch.nn.Parameter)
        and x.layout is torch.strided
        and (x.requires_grad or type(x) is not torch.Tensor)
    )


def as_pickled(live: torch.Tensor, staged: torch.Tensor) -> torch.Tensor:
    """The snapshot's ``staged`` copy of the plain tensor ``live`` inside a tuple (pickled whole, a tensor's
    class and ``requires_grad`` with it): a Parameter stays one, the flag is kept, as a sync save pickles
    them (an object that sets a restored Parameter back on a module needs one). Over the same memory."""
    if type(live) is torch.nn.Parameter:
        return torch.nn.Parameter(staged, requires_grad=live.requires_grad)
    return staged.detach().requires_grad_() if live.requires_grad else staged
