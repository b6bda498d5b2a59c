"""Whether a module already holds what was loaded, so that ``load_state_dict`` can be skipped.

A restore loads into the module's own state dict (``get_state_dict``: for a plain module, tensors that
share memory with the live parameters and buffers), reading each tensor straight into that memory
(``store/direct_read.py``) or copying into it. Afterwards ``set_state_dict`` -> ``Module.load_state_dict``
would copy every tensor onto itself, and torch's ``load_state_dict`` filters the whole state dict by prefix
for every submodule: quadratic in the number of modules (1.1 s of a 1,250-layer restore). It is skipped
only when it cannot do anything else: no module overrides how it loads or has load hooks, the loaded keys
are exactly the live ones, and every loaded tensor is the live tensor's memory (same address, dtype,
shape, strides, device). Anything else (DDP or FSDP wrappers, DTensors, a BatchNorm's own
``_load_from_state_dict``, a tensor DCP replaced) takes ``set_state_dict`` as before.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from safepoint.state import MODEL, MODULES, TrainState

_PLAIN = (torch.Tensor, nn.Parameter)


def holds_loaded(module: nn.Module, loaded: dict[str, Any]) -> bool:
    """True when every entry of ``loaded`` (the module's state dict, loaded in place) already is the live
    parameter's or buffer's memory and ``module.load_state_dict`` would only copy it onto itself."""
    if type(module).load_state_dict is not nn.Module.load_state_dict:
        return False
    for m in module.modules():
        if (
            m._load_state_dict_pre_hooks
            or m._load_state_dict_post_hooks
            or type(m)._load_from_state_dict is not nn.Module._load_from_state_dict
        ):
            return False
    live = module.state_dict(keep_vars=True)
    if live.keys() != loaded.keys():
        return False
    for key, have in live.items():
        got = loaded[key]
        if type(got) is not torch.Tensor or type(have) not in _PLAIN:
            return False
        if (
            got.is_meta
            or got.data_ptr() != have.data_ptr()
            or got.dtype != have.dtype
            or got.shape != have.shape
            or got.stride() != have.stride()
            or got.device != have.device
        ):
            return False
    return True


def loaded_in_place(state: TrainState, loaded: dict[str, Any]) -> frozenset[str]:
    """The module sections of ``state`` (``model``, ``modules.<name>``) that hold ``loaded`` already."""
    found: set[str] = set()
    if state.model is not None and MODEL in loaded and holds_loaded(state.model, loaded[MODEL]):
        found.add(MODEL)
    for name, module_sd in loaded.get(MODULES, {}).items():
        module = (state.modules or {}).get(name)
        if module is not None and holds_loaded(module, module_sd):
            found.add(f"{MODULES}.{name}")
    return frozenset(found)
