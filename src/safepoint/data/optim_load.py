"""Load a plain optimizer's restored state without torch's quadratic split.

``set_state_dict`` hands each optimizer its share of the loaded, FQN-keyed optimizer state through
``_split_optim_state_dict``, which tests ``fqn in param_group["params"]`` (a list) for every parameter:
quadratic in the number of parameters (3.2 s of a 20,000-parameter restore, issue 27). In the common case
the split is an identity and can be proven one in linear time:

- one optimizer for the module, every parameter of it a plain (not sharded) tensor that appears under one
  name only, and that name is DCP's FQN of it (no wrapper renames it: ``_get_fqns``, the function DCP
  itself uses, maps it to itself);
- no empty param group, and the loaded param groups list exactly the FQNs of the live groups, in order.

A parameter the loaded groups name without a state gets none, as ``set_state_dict(strict=False)`` leaves it:
the saved optimizer had none (restore/stateless.py decided that from the checkpoint before loading).

The split then returns the loaded groups (``params`` equal to the FQNs it rebuilds) and the loaded state of
the parameters that require grad and have one, which is what is built here and handed to the same
``Optimizer.load_state_dict``, after the same ``_init_optim_state``. Anything else returns False and the
caller goes through ``set_state_dict`` as before.

``Optimizer.load_state_dict`` itself is quadratic too: for every tensor of every parameter's state
(``exp_avg``, ``exp_avg_sq``, ``step``: 3 per Adam parameter) ``_process_value_according_to_param_policy``
scans the saved groups for ``param_id in group["params"]``, a list (11.5 s of a 30 s profiled
10,000-parameter restore, issue 27). It runs unchanged here, on saved groups whose ``params`` answer ``in``
from a set (:func:`fast_membership`): the same code decides every cast, in linear time.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import _get_fqns, _init_optim_state
from torch.distributed.tensor import DTensor

_STATE, _GROUPS, _PARAMS = "state", "param_groups", "params"


def in_order(model: nn.Module, optims: list[torch.optim.Optimizer], loaded: Any) -> Callable[[], None] | None:
    """What loads ``loaded`` (an optimizer state dict keyed by FQN) into the one optimizer of ``optims``
    exactly as ``set_state_dict`` would, in linear time (see the module docstring); None: use that."""
    if len(optims) != 1 or not isinstance(loaded, dict) or loaded.keys() != {_STATE, _GROUPS}:
        return None
    optim = optims[0]
    state, groups = loaded[_STATE], loaded[_GROUPS]
    if not isinstance(state, dict) or not isinstance(groups, list) or len(groups) != len(optim.param_groups):
        return None
    if not state:
        return None  # no state at all (SGD without momentum): the split hands it on as it is, at once
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in names or isinstance(param, DTensor):
            return None  # shared (several FQNs) or sharded: the split does more than pick
        names[id(param)] = name
    picked: dict[str, Any] = {}
    for live, saved in zip(optim.param_groups, groups, strict=True):
        params = live[_PARAMS]
        if not params or not isinstance(saved, dict):
            return None
        fqns = [names.get(id(p)) for p in params]
        if saved.get(_PARAMS) != fqns:
            return None
        for fqn, param in zip(fqns, params, strict=True):
            assert fqn is not None  # every live param is named (else the comparison above failed)
            if _get_fqns(model, fqn) != {fqn}:
                return None
            if param.requires_grad and fqn in state:  # none: the saved optimizer had none (stateless)
                picked[fqn] = state[fqn]

    def load() -> None:
        _init_optim_state(optim)
        optim.load_state_dict({_STATE: picked, _GROUPS: fast_membership(groups)})

    return load


def fast_membership(groups: list[Any]) -> list[Any]:
    """``groups`` (an optimizer state dict's ``param_groups``) with each group copied and its ``params``
    a :class:`_Params`: what ``Optimizer.load_state_dict`` reads is unchanged, its per-value scan is no
    longer quadratic. Anything that is not a list of dicts holding a list is passed on as it is."""
    out: list[Any] = []
    for group in groups:
        if isinstance(group, dict) and type(group.get(_PARAMS)) is list:
            group = {**group, _PARAMS: _Params(group[_PARAMS])}
        out.append(group)
    return out


class _Params(list[Any]):
    """A saved group's ``params`` whose ``in`` is a set lookup, for ``Optimizer.load_state_dict``.

    The same answer as the list's own ``in`` for every id there: the ids are the saved ``state``'s keys
    (FQN strings, or indices), hashable, with a hash that agrees with ``==``; each group still answers for
    itself, in the groups' order, so the first group that lists an id is the one whose flags apply, as
    before. An unhashable id or entry falls back to the list's scan. The set is built at the first ``in``,
    after the load's pre-hooks (which may edit the list), and again if the list's length changed since.
    ``load_state_dict`` deep copies the groups it keeps: the copy is a plain list (then replaced by the
    live parameters anyway)."""

    __slots__ = ("_length", "_members")

    def __init__(self, items: list[Any]) -> None:
        super().__init__(items)
        self._members: frozenset[Any] | None = None
        self._length = -1  # the list's length when ``_members`` was built

    def __contains__(self, item: object) -> bool:
        if self._members is None or self._length != len(self):
            try:
                self._members, self._length = frozenset(self), len(self)
            except TypeError:  # an unhashable entry: no set, the list's own scan
                return list.__contains__(self, item)
        try:
            return item in self._members
        except TypeError:
            return list.__contains__(self, item)

    def __deepcopy__(self, memo: dict[int, Any]) -> list[Any]:
        return [copy.deepcopy(item, memo) for item in self]
