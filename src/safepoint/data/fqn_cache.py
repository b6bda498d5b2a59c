"""``get_state_dict`` of a plain module and its optimizers, from parameter names learned once.

torch's ``get_state_dict(model, optimizers)`` re-derives every parameter's fully qualified name on every
call (``_verify_options`` walks the module tree and builds its maps; each optimizer's ids are renamed
through ``named_parameters``): ~0.8 ms of a small state's ~10 ms save, and per parameter on a large one
(issue 27). For a plain single-device module the answer is ``model.state_dict()`` and each optimizer's
``state_dict()`` with its parameter indices replaced by names, and the names never change while the
module and optimizers hold the same parameters.

So the first call (and any call after a change) asks torch, and then checks that the plain recipe gives
exactly torch's answer: the same keys in the same order, the same tensors (storage, shape, strides, dtype),
equal values otherwise. Only then are the names kept, with what they were learned from: the model's
state-dict keys, the identity of every parameter of the model and of the optimizers, in order, and of each
module's children (which of two places sharing a module names it). A later call takes the plain recipe
only while all of that is unchanged; anything else (a wrapper that renames keys,
such as DDP or ``torch.compile``, a DTensor or FSDP parameter, a parameter replaced, a param group added,
an optimizer with no state yet, which torch initialises with a step of zero gradients) asks torch.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict


class _Names:
    """What one module's names were learned from, and the names (per optimizer, by parameter index)."""

    def __init__(self, keys: tuple[str, ...], ids: tuple[int, ...], names: list[list[str]]) -> None:
        self.keys, self.ids, self.names = keys, ids, names


_PLAIN_PARAMS = frozenset({nn.Parameter, type(None)})

_LEARNED: weakref.WeakKeyDictionary[nn.Module, _Names] = weakref.WeakKeyDictionary()


def state_dicts(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> tuple[dict[str, Any], Any]:
    """``get_state_dict(model, optimizers)``, the same answer (see the module docstring)."""
    ids = _identity(model, optimizers)
    known = _LEARNED.get(model)
    if ids is not None and known is not None and known.ids == ids:
        plain = _plain(model, optimizers, known.names)
        if plain is not None and tuple(plain[0]) == known.keys:
            return plain
    model_sd, optim_sd = get_state_dict(model, optimizers)
    _LEARNED.pop(model, None)
    if ids is not None:
        names = _names(model, optimizers)
        plain = _plain(model, optimizers, names) if names is not None else None
        if names is not None and plain is not None and _same(plain, (model_sd, optim_sd)):
            _LEARNED[model] = _Names(tuple(model_sd), ids, names)
    return model_sd, optim_sd


def _identity(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> tuple[int, ...] | None:
    """The ids of each module's children and parameters, then of each optimizer's parameters (by group),
    with separators; None when a parameter is not a plain ``nn.Parameter`` (a DTensor, FSDP's flat
    parameter: torch's path)."""
    # Each module's own parameters, read from its ``_parameters`` in C (``map``), not through
    # ``model.parameters()``, whose de-duplication hashes every parameter in Python (``Tensor.__hash__``):
    # 3,000 parameters cost ~2 ms per save that way. The tuple is only ever compared with one made here, and
    # any parameter replaced, added, removed or moved still changes it (a tied one is listed twice, an
    # unset one, ``bias=None``, as None's id).
    # Each module's children too, in order: the names torch gives (a parameter or module reached by two
    # paths is named by the first) follow the module graph, which the parameters' ids alone do not fix
    # (one module shared by a and b, then by b and c: the same parameters in the same order, the same
    # state-dict keys, but the shared parameters named b.* now, not c.*; tests/data/test_rev5_fqn_swap.py).
    # Walked here, depth first, each module once (not ``model.modules()``, which builds every module's
    # dotted name as it goes): only ever compared with a tuple made the same way.
    out: list[int] = []
    kinds: set[type] = set()
    seen = {id(model)}
    todo = [model]
    while todo:
        module = todo.pop()
        children = module._modules.values()
        out.append(-3)  # one mark per module is enough: every id is of a live object, distinct
        if children:
            out.extend(map(id, children))
            for child in reversed(children):  # reversed: popped in their order
                if child is not None and id(child) not in seen:
                    seen.add(id(child))
                    todo.append(child)
        params = module._parameters.values()
        if params:
            kinds.update(map(type, params))
            out.extend(map(id, params))
    if not kinds <= _PLAIN_PARAMS:
        return None
    for opt in optimizers:
        out.append(-1)
        for group in opt.param_groups:
            out.append(-2)
            out.extend(map(id, group["params"]))
    return tuple(out)


def _names(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> list[list[str]] | None:
    """Each optimizer's parameter names, by index; None if a parameter is not the model's."""
    by_id = {id(p): name for name, p in model.named_parameters()}  # a tied one: its first name, as torch
    out = []
    for opt in optimizers:
        params = [p for group in opt.param_groups for p in group["params"]]
        if any(id(p) not in by_id for p in params):
            return None
        out.append([by_id[id(p)] for p in params])
    return out


def _plain(
    model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], names: list[list[str]]
) -> tuple[dict[str, Any], Any] | None:
    """``model.state_dict()`` and the optimizers' state dicts named by ``names``; None if an optimizer
    has no state yet (torch initialises it: its path)."""
    if not optimizers:
        return model.state_dict(), {}  # torch's answer without optimizers
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for opt, by_index in zip(optimizers, names, strict=True):
        if not opt.state:
            return None
        osd = opt.state_dict()
        for index, value in osd["state"].items():
            state[by_index[index]] = value
        for group in osd["param_groups"]:
            group["params"] = [by_index[i] for i in group["params"]]
            groups.append(group)
    return model.state_dict(), {"state": state, "param_groups": groups}


def _same(a: Any, b: Any) -> bool:
    """Equal, keys in the same order, tensors the very same data (not merely equal values)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            type(a) is type(b)
            and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape
            and a.stride() == b.stride()
            and a.dtype == b.dtype
            and a.device == b.device
        )
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and list(a) == list(b)
            and all(type(k) is type(j) for k, j in zip(a, b, strict=True))
            and all(_same(a[k], b[k]) for k in a)
        )
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and bool(a == b)
