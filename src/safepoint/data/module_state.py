"""A module's state dict and its optimizers', also for modules whose ``state_dict`` hooks rename keys.

DCP's ``get_state_dict`` (what a TrainState saves and loads a module through) maps every key of
``module.state_dict()`` back to an attribute path, to strip the ``module.``/``_orig_mod.`` prefixes of DDP
and ``torch.compile``. A module whose state-dict post-hook writes keys that are no attribute path fails
there: torchtitan 0.3's ``FusedQKVLinear`` (the Llama 3 debug model's default attention) holds one ``wqkv``
parameter and saves it as the stock ``wq``/``wk``/``wv`` (``AttributeError: 'FusedQKVLinear' object has no
attribute 'wq'``); its load pre-hook merges them back.

Such a module is saved and loaded as torchtitan's own checkpointer does (``ModelWrapper`` in
``torchtitan/components/checkpointer/base.py``): the weights are the module's own ``state_dict()``, hooks
applied (so the checkpoint has the stock layout, the keys torchtitan's would have, loadable into the
unfused model too), and go back through its ``load_state_dict`` (its pre-hooks merge them); the optimizer
state stays keyed by the parameters' names (``get_optimizer_state_dict``, ``wqkv``), as torchtitan's
``OptimizersContainer`` keys it. Every other module keeps ``get_state_dict``: only a module that fails it
for this reason, and holds no FSDP1 wrapper (whose sharded state dict needs DCP's context), takes this way.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX as _EXTRA_STATE
from torch.nn.parallel import DistributedDataParallel

from safepoint.data import fqn_cache

# Modules already found to rename keys: later saves take the hooks' way at once. Weak: a module that is
# gone is forgotten (a new one at the same address is checked afresh).
_RENAMING: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def module_state_dicts(
    module: nn.Module, optims: list[torch.optim.Optimizer], *, as_saved: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``get_state_dict(module, optims)``, or torchtitan's way for a module whose hooks rename keys.

    ``as_saved`` (a save's capture): an optimizer that has not stepped yet is captured without state and
    left without it. DCP gives such an optimizer a state by stepping it once with zero gradients and a zero
    learning rate (``_init_optim_state``): saved so, a resume would go on from step 1 where the run went on
    from 0 (Adam's bias correction differs), and the live optimizer too, so a save before the first step
    changed the training that followed. A restore's template keeps DCP's state: it gives the loaded values
    their places, and restore/stateless.py drops what the checkpoint holds none of."""
    fresh = {id(o) for o in optims if not o.state} if as_saved else set()
    model_sd, optim_sd = _state_dicts(module, optims)
    if fresh and any(o.state for o in optims if id(o) in fresh):
        _forget_made_up_state(optims, fresh, optim_sd)
    return model_sd, optim_sd


def _state_dicts(
    module: nn.Module, optims: list[torch.optim.Optimizer]
) -> tuple[dict[str, Any], dict[str, Any]]:
    if module not in _RENAMING:
        try:
            return fqn_cache.state_dicts(module, optims)  # get_state_dict's answer, names cached
        except AttributeError:
            if not _renames_keys(module):
                raise
            _RENAMING.add(module)
    own = _unwrapped(module)
    optim_sd = get_optimizer_state_dict(own, optims) if optims else {}
    return dict(own.state_dict()), optim_sd


def _forget_made_up_state(
    optims: list[torch.optim.Optimizer], fresh: set[int], optim_sd: dict[str, Any]
) -> None:
    """Drop the state DCP made up for the ``fresh`` optimizers, from the captured dict and from the live
    optimizers. The captured groups follow the optimizers' groups in order (DCP extends one list per
    optimizer); if they do not line up, nothing is dropped (DCP's answer is saved as before)."""
    groups = optim_sd.get("param_groups", [])
    if len(groups) != sum(len(o.param_groups) for o in optims):
        return
    made_up: list[Any] = []
    owners = [id(o) for o in optims for _ in o.param_groups]
    for owner, group in zip(owners, groups, strict=True):
        if owner in fresh:
            made_up += group["params"]
    for name in made_up:
        optim_sd["state"].pop(name, None)
    for o in optims:
        if id(o) in fresh:
            o.state.clear()


def set_module_state(
    module: nn.Module, optims: list[torch.optim.Optimizer], model_sd: dict[str, Any], optim_sd: Any
) -> None:
    """``set_state_dict``; for a module whose hooks rename keys, its own ``load_state_dict`` (strict: every
    key the hooks expect, none left over) and ``set_optimizer_state_dict`` for its optimizers.

    A parameter the loaded param groups name without a state (the saved optimizer had none for it:
    restore/stateless.py) gets none: the optimizer is loaded with ``strict=False``, which skips exactly
    such parameters (DCP's split raises for them otherwise), the weights as before."""
    stateless = optims and _named_without_state(optim_sd)
    if module not in _RENAMING and not stateless:
        set_state_dict(module, optims, model_state_dict=model_sd, optim_state_dict=optim_sd)
        return
    own = module if module not in _RENAMING else _unwrapped(module)
    if model_sd:
        own.load_state_dict(model_sd) if module in _RENAMING else set_model_state_dict(module, model_sd)
    if optims:
        options = StateDictOptions(strict=not stateless)
        for optim, part in _per_optimizer(optims, optim_sd):
            set_optimizer_state_dict(own, optim, part, options=options)


def _per_optimizer(optims: list[torch.optim.Optimizer], optim_sd: Any) -> list[tuple[Any, Any]]:
    """``optim_sd`` split among ``optims`` by their groups, in order (DCP's split hands the whole dict to each
    optimizer when ``state`` is empty, e.g. none of them had stepped when saved: "a different number of
    parameter groups"); the whole of it to them all when the groups do not line up (DCP decides)."""
    groups = optim_sd.get("param_groups") if isinstance(optim_sd, dict) else None
    if len(optims) == 1 or not isinstance(groups, list):
        return [(optims, optim_sd)]
    if len(groups) != sum(len(o.param_groups) for o in optims):
        return [(optims, optim_sd)]
    out, start = [], 0
    for optim in optims:
        mine = groups[start : start + len(optim.param_groups)]
        start += len(optim.param_groups)
        names = {p for g in mine for p in g.get("params", ())}
        state = {k: v for k, v in optim_sd.get("state", {}).items() if k in names}
        out.append(([optim], {"state": state, "param_groups": mine}))
    return out


def _named_without_state(optim_sd: Any) -> bool:
    """Whether ``optim_sd`` (FQN-keyed) has a param group naming a parameter its ``state`` has nothing for."""
    if not isinstance(optim_sd, dict) or not isinstance(optim_sd.get("state"), dict):
        return False
    state = optim_sd["state"]
    return any(
        isinstance(group, dict) and any(p not in state for p in group.get("params", ()) if isinstance(p, str))
        for group in optim_sd.get("param_groups", ())
    )


def _unwrapped(module: nn.Module) -> nn.Module:
    """The module under DDP and ``torch.compile`` wrappers: keys without their prefixes, as
    ``get_state_dict`` gives them."""
    while True:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        elif isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
            module = module._orig_mod
        else:
            return module


def _renames_keys(module: nn.Module) -> bool:
    """Whether ``module``'s state dict has a key that is no attribute path (a post-hook renamed it), and
    nothing in it needs DCP's FSDP1 handling."""
    own = _unwrapped(module)
    if any(isinstance(m, FullyShardedDataParallel) for m in own.modules()):
        return False
    for key in own.state_dict():
        if key.endswith(_EXTRA_STATE):  # get_extra_state(): a key of its own, no attribute
            continue
        target: Any = own
        for name in key.split("."):
            target = getattr(target, name, None)
            if target is None:
                return True
    return False
