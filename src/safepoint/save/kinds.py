"""The container types of an async save's snapshot (save/stage_plan.py's walk copies every container).

A tuple or list subclass keeps its type (a ``torch.Size``, a namedtuple: a sync save writes it so, and
restore loads it so). A dict becomes a plain dict, since DCP stores a dict's keys, never its type, except
inside a tuple, which DCP stores as one pickled value, container types and all."""

from __future__ import annotations

import copy
from typing import Any


def same_dict(v: dict[Any, Any], items: dict[Any, Any]) -> dict[Any, Any]:
    """``items`` (the copied entries of the dict subclass ``v``) in a dict of ``v``'s type: a shallow copy
    of ``v`` emptied and refilled, so what its constructor needs (a defaultdict's factory) comes with it,
    and its attributes copied deep (pickled with it, as a state dict's ``_metadata``: no later write to the
    live dict's may reach the snapshot). A type that cannot be copied so stays the plain dict the copy was."""
    try:
        out = copy.copy(v)
        out.clear()
        out.update(items)
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
