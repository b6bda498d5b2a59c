"""Traceable wrapper tensor subclasses in async staging (torchao's NF4Tensor, QLoRA's frozen 4-bit base;
its float8 tensors): their buffers, their signature, their copy.

Such a tensor holds no data of its own (its ``data_ptr()`` is 0): its values are in inner tensors that
``__tensor_flatten__`` names, with a context (its metadata) that ``__tensor_unflatten__`` rebuilds it from.
A sync save pickles it as it is: its class and ``__dict__``, inner tensors and other attributes included.
torch's ``_create_cpu_state_dict`` allocated a buffer for one with ``zeros_like``: NF4Tensor refuses that op
(the async save failed), and a wrapper whose ``zeros_like`` unwraps got a *plain* buffer (the checkpoint
held another item type than a sync save's). So the buffer is made here, never relying on the subclass's
``empty_like``/``zeros_like``/``copy_``: every inner plain tensor gets a host buffer of its dtype, shape and
strides (pinned where it lives on CUDA), a nested wrapper one of its own, and the wrapper is rebuilt over them
with ``type(t).__tensor_unflatten__(buffers, context, size, stride)``. Each save copies the inner tensors
(one batched copy) and mirrors the live wrapper's other attributes (deep copies: no later write reaches the
snapshot), so the snapshot pickles as the live tensor does. The process writer finds the inner buffers in the
shared segment (``shared_buffers.buffer_tensors`` reaches them) and is handed the wrapper by its inner
tensors' places (save/handoff.py).

The buffers are valid for a wrapper with the same type, size, strides, dtype, device and ``requires_grad``,
the same inner names with the same dtype, shape, strides and device, and an equal context (``token``). A
context that cannot be compared (a copy of it is not equal to it) makes a signature equal to nothing, so such
a wrapper gets a new buffer set at every save: never a stale one. DTensor is a wrapper subclass too; it has
a path of its own (save/stage_plan.py) and is not handled here.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def flatten(t: Any) -> tuple[list[str], Any]:
    """``t.__tensor_flatten__()``: the names of its inner tensors and its context."""
    names, ctx = t.__tensor_flatten__()
    return list(names), ctx


def unflatten(kind: Any, inner: dict[str, torch.Tensor], ctx: Any, size: Any, stride: Any) -> torch.Tensor:
    """``kind.__tensor_unflatten__(inner, ctx, size, stride)``: the wrapper rebuilt over ``inner``."""
    out: torch.Tensor = kind.__tensor_unflatten__(inner, ctx, size, stride)
    return out


def stageable(t: Any) -> bool:
    """A traceable wrapper subclass (not a DTensor) whose inner tensors are, all the way down, plain strided
    tensors or such wrappers: staged here. Any other tensor item keeps torch's own path."""
    if not is_traceable_wrapper_subclass(t) or isinstance(t, DTensor):
        return False
    for name in flatten(t)[0]:
        x = getattr(t, name)
        if not (type(x) in _PLAIN_TYPES and x.layout == torch.strided) and not stageable(x):
            return False
    return True


def inner_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors holding a ``stageable`` wrapper's data, nested wrappers flattened, in order."""
    for name in flatten(t)[0]:
        x = getattr(t, name)
        if type(x) in _PLAIN_TYPES:
            yield x
        else:
            yield from inner_tensors(x)


class _Context:
    """A flatten context in a signature: a private deep copy (a later write to the live one must not change
    what the plan remembers), equal to another by ``==`` of the copies; an error is "not equal"."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        if type(other) is not _Context:
            return False
        try:
            return bool(self.value == other.value)
        except Exception:
            return False

    def __hash__(self) -> int:
        return 0  # equal contexts must hash alike, and only the wrapper's other fields tell them apart


def _context(ctx: Any) -> Any:
    """``ctx`` as a signature entry: a ``_Context`` where a copy of it compares equal to it, otherwise a new
    object equal to nothing (such a wrapper's buffers are never reused)."""
    try:
        frozen = copy.deepcopy(ctx)
        if bool(frozen == ctx):
            return _Context(frozen)
    except Exception:
        pass
    return object()


def token(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes a wrapper's buffer valid for ``t`` (see the module docstring); None where ``t`` is not
    ``stageable``. One flatten per wrapper (this runs at every save: torchao's flatten costs ~40 us)."""
    if not is_traceable_wrapper_subclass(t) or isinstance(t, DTensor):
        return None
    names, ctx = flatten(t)
    parts: list[tuple[Any, ...]] = []
    for name in names:
        x = getattr(t, name)
        if type(x) in _PLAIN_TYPES and x.layout == torch.strided:
            parts.append((name, x.device, x.dtype, tuple(x.shape), x.stride()))
        elif (inner := token(x)) is not None:
            parts.append((name, inner))
        else:
            return None
    shape, stride = tuple(t.shape), t.stride()
    return (type(t), t.device, t.dtype, shape, stride, t.requires_grad, tuple(parts), _context(ctx))


class _Hole:
    """Where a wrapper stands in the state handed to ``_create_cpu_state_dict`` (which deep-copies what is
    not a tensor or a container: a hole stays itself, so ``_filled`` finds it)."""

    __slots__ = ("live",)

    def __init__(self, live: torch.Tensor) -> None:
        self.live = live

    def __deepcopy__(self, memo: dict[int, Any]) -> _Hole:
        return self


def cpu_buffers(sd: Any, *, pin_memory: bool) -> Any:
    """torch's ``_create_cpu_state_dict(sd, pin_memory=...)``, with a buffer of our own for every
    ``stageable`` wrapper (``buffer_for``) instead of torch's ``zeros_like`` of it. Once per buffer set."""
    holes: list[_Hole] = []
    bare = _holed(sd, holes)
    buffers = _create_cpu_state_dict(bare, pin_memory=pin_memory)
    return _filled(buffers, pin_memory) if holes else buffers


def _holed(v: Any, holes: list[_Hole]) -> Any:
    if isinstance(v, torch.Tensor):
        if not stageable(v):
            return v
        holes.append(_Hole(v))
        return holes[-1]
    if isinstance(v, dict):
        return {k: _holed(x, holes) for k, x in v.items()}
    if isinstance(v, (list, tuple)):  # torch's function makes a plain list or tuple of either anyway
        out = [_holed(x, holes) for x in v]
        return tuple(out) if isinstance(v, tuple) else out
    return v


def _filled(v: Any, pin: bool) -> Any:
    if isinstance(v, _Hole):
        return buffer_for(v.live, pin)
    if isinstance(v, dict):
        for k, x in v.items():
            v[k] = _filled(x, pin)
        return v
    if isinstance(v, list):
        v[:] = [_filled(x, pin) for x in v]
        return v
    if isinstance(v, tuple):
        return tuple(_filled(x, pin) for x in v)
    return v


def buffer_for(live: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host buffer of the ``stageable`` wrapper ``live``: the same wrapper rebuilt over host buffers of its
    inner tensors (pinned where ``pin`` and the inner tensor is on CUDA), its other attributes mirrored."""
    names, ctx = flatten(live)
    inner: dict[str, torch.Tensor] = {}
    for name in names:
        x = getattr(live, name)
        if type(x) not in _PLAIN_TYPES:
            inner[name] = buffer_for(x, pin)
            continue
        # Its own strides where they cover exactly its bytes (a transposed weight stays transposed), packed
        # otherwise (a view into a larger storage: only its values are the tensor's): empty_like's rule.
        inner[name] = torch.empty_like(x.detach(), device="cpu", pin_memory=pin and x.is_cuda)
    buf = unflatten(type(live), inner, copy.deepcopy(ctx), live.size(), live.stride())
    if live.requires_grad:
        buf.requires_grad_()
    _mirror(buf, live, names)
    return buf


def _mirror(buf: torch.Tensor, live: torch.Tensor, names: list[str]) -> None:
    """Give ``buf`` the attributes of ``live`` (its ``__dict__``, in its order: a pickle writes them so),
    deep copies of all but the inner tensors ``names``, which stay ``buf``'s own."""
    inner = set(names)
    with_state(buf, inner, [(k, None if k in inner else copy.deepcopy(v)) for k, v in live.__dict__.items()])


def with_state(t: torch.Tensor, inner: set[str], state: list[tuple[str, Any]]) -> torch.Tensor:
    """``t`` with ``state`` (``__dict__``'s (key, value) pairs in order) for its ``__dict__``, except that the
    keys in ``inner`` (its inner tensors) keep ``t``'s own values, wherever ``state`` puts them."""
    own = t.__dict__
    new = {k: (own[k] if k in own else getattr(t, k)) if k in inner else v for k, v in state}
    for k in inner:
        if k in own and k not in new:
            new[k] = own[k]  # an inner tensor the source keeps elsewhere (a property): this one's stays
    t.__dict__ = new
    return t


def _pairs(buf: Any, live: Any, out: list[tuple[Any, Any, Any]]) -> bool:
    """Whether ``buf`` is a wrapper buffer of ``live`` (the same type, each inner tensor a plain buffer
    or such a wrapper, nested): then ``out`` gets (buffer, live, names) of it and its nested wrappers."""
    if type(buf) is not type(live) or not is_traceable_wrapper_subclass(live) or isinstance(live, DTensor):
        return False
    names = flatten(live)[0]
    for name in names:
        x, b = getattr(live, name), getattr(buf, name, None)
        plain = type(x) in _PLAIN_TYPES and x.layout == torch.strided
        if not (plain and type(b) is torch.Tensor) and not (not plain and _pairs(b, x, out)):
            return False
    out.append((buf, live, names))
    return True


def copy_opaque(pairs: list[tuple[Any, Any]]) -> None:
    """Copy each (buffer, live item) of the tensor items the batched plain copy does not: a wrapper by its
    inner tensors (one batched copy for all of them) and its other attributes (``_mirror``), any other (a
    ShardedTensor's shards, a wrapper torch's own function allocated) with torch's ``_copy_state_dict``.
    non_blocking: the caller synchronises before the writer reads the buffers. One flatten per wrapper."""
    targets: list[torch.Tensor] = []
    lives: list[torch.Tensor] = []
    for buf, live in pairs:
        found: list[tuple[Any, Any, Any]] = []
        if not _pairs(buf, live, found):
            _copy_state_dict({"v": live}, {"v": buf}, non_blocking=True, type_check=False)
            continue
        for b, x, names in found:
            _mirror(b, x, names)
            for name in names:
                t = getattr(x, name)
                if type(t) in _PLAIN_TYPES:
                    targets.append(getattr(b, name))
                    lives.append(t)
    if targets:
        with torch.no_grad():
            torch._foreach_copy_(targets, lives, non_blocking=True)
