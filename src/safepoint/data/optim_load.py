"""Load a plain optimizer's restored state without torch's quadratic split.

``set_state_dict`` hands each optimizer its share of the loaded, FQN-keyed optimizer state through
``_split_optim_state_dict``, which tests ``fqn in param_group["params"]`` (a list) for every parameter:
quadratic in the number of parameters (3.2 s of a 20,000-parameter restore, issue 27). In the common case
the split is an identity and can be proven one in linear time:

- one optimizer for the module, every parameter of it a plain (not sharded) tensor that appears under one
  name only, and that name is DCP's FQN of it (no wrapper renames it: ``_get_fqns``, the function DCP
  itself uses, maps it to itself);
- no empty param group, and the loaded param groups list exactly the FQNs of the live groups, in order;
- every parameter that requires grad has a loaded state (DCP raises otherwise: that case keeps its error).

The split then returns the loaded groups (``params`` equal to the FQNs it rebuilds) and the loaded state of
the parameters that require grad, which is what is built here and handed to the same
``Optimizer.load_state_dict``, after the same ``_init_optim_state``. Anything else returns False and the
caller goes through ``set_state_dict`` as before.
"""

from __future__ import annotations

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
            if param.requires_grad:
                if fqn not in state:
                    return None
                picked[fqn] = state[fqn]

    def load() -> None:
        _init_optim_state(optim)
        optim.load_state_dict({_STATE: picked, _GROUPS: groups})

    return load
