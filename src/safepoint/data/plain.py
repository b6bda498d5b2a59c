"""PlainState: a dict of plain containers saved as it is and restored without a template.

A restore normally loads *into* live objects: the state being restored says which keys exist, and DCP fills
them in place. A framework's own checkpoint (a Lightning ``CheckpointIO.load_checkpoint(path) -> dict``, a
fresh optimizer's empty ``state``) has no live object to say that: the keys are whatever was saved. A
``PlainState`` in ``TrainState(objects=...)`` or ``extra=`` is restored from the checkpoint's own key list
(``.metadata``, every byte checked against the manifest as it is read, non-tensors loaded weights-only).

DCP's flattening loses three things a framework's dict holds: dict keys become strings (``{0: ...}`` comes
back as ``{"0": ...}``), empty dicts vanish, and a tuple holding a tensor comes back as a list. ``encode``
marks those three so ``decode`` gives back the very same structure: what was saved is what is loaded.
"""

from __future__ import annotations

from typing import Any

import torch

from safepoint.data.optim_load import fast_membership

_KEYS = "\x00keys"  # a dict with a key that is not a string: its keys, by position
_EMPTY = "\x00empty"  # an empty dict (DCP would drop it)
_TUPLE = "\x00tuple"  # a tuple with a tensor inside (DCP would give back a list)


def encode(value: Any) -> Any:
    """``value`` in a form DCP's flattening gives back exactly (see the module docstring)."""
    if isinstance(value, dict):
        if not value:
            return {_EMPTY: True}
        if all(isinstance(k, str) and not k.startswith("\x00") for k in value):
            return {k: encode(v) for k, v in value.items()}
        keys = list(value)
        out = {str(i): encode(value[k]) for i, k in enumerate(keys)}
        out[_KEYS] = keys  # a leaf: a list of plain keys (ints, strings) is saved as one value
        return out
    if isinstance(value, tuple) and _holds_tensor(value):
        return {_TUPLE: [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    return value


def decode(value: Any) -> Any:
    """The inverse of :func:`encode` on what a restore loaded."""
    if isinstance(value, dict):
        if _EMPTY in value:
            return {}
        if _TUPLE in value:
            return tuple(decode(v) for v in value[_TUPLE])
        if _KEYS in value:
            return {k: decode(value[str(i)]) for i, k in enumerate(value[_KEYS])}
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def own_optimizer_sd(opt: torch.optim.Optimizer | list[torch.optim.Optimizer]) -> dict[str, Any]:
    """An optimizer without a model: its own state dict (a list of them: one per position)."""
    if isinstance(opt, torch.optim.Optimizer):
        return opt.state_dict()
    return {str(i): o.state_dict() for i, o in enumerate(opt)}


def load_own_optimizer_sd(opt: torch.optim.Optimizer | list[torch.optim.Optimizer], sd: Any) -> None:
    if isinstance(opt, torch.optim.Optimizer):
        load_stateful(opt, sd)
    else:
        for i, o in enumerate(opt):
            load_stateful(o, sd[str(i)])


def load_stateful(obj: Any, sd: Any) -> None:
    """``obj.load_state_dict(sd)``; an optimizer's ``state`` keyed back by int: a template-free load gives
    the keys as DCP names them (strings), and ``Optimizer.load_state_dict`` skips keys it does not know."""
    if isinstance(obj, torch.optim.Optimizer) and isinstance(sd.get("state"), dict):
        sd = {**sd, "state": {int(k) if isinstance(k, str) and k.isdigit() else k: v
                              for k, v in sd["state"].items()}}  # fmt: skip
        if isinstance(sd.get("param_groups"), list):  # linear, not quadratic (data/optim_load.py)
            sd["param_groups"] = fast_membership(sd["param_groups"])
    obj.load_state_dict(sd)


class PlainState:
    """A dict saved as it is; restored as what was saved, whatever this object held before.

    Put it in ``TrainState(objects={"name": PlainState(d)})`` (replicated across ranks) or ``extra=``
    (per rank). After ``restore``, ``.value`` is the saved dict (tensors on the CPU, non-tensors loaded
    weights-only). Values must be what ``torch.load(weights_only=True)`` accepts: a save refuses others.
    """

    def __init__(self, value: dict[str, Any] | None = None) -> None:
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"PlainState(value) must be a dict, got {type(value).__name__}")
        self.value: dict[str, Any] = value if value is not None else {}
        """The dict saved by the next save; after a restore, the dict that was saved."""

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = encode(self.value)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value = decode(state_dict)
