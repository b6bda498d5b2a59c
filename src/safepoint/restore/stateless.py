"""Parameters the saved optimizer held no state for: left without state, not reported missing.

A restore's template for an optimizer keyed by a model comes from DCP's ``get_state_dict``, which first
steps a fresh optimizer with zero gradients (``_init_optim_state``) so that every parameter requiring grad
has a state. The optimizer that was saved may have none for some: a parameter that never received a
gradient before the save (an unused pooler, an MoE expert no token was routed to, a head of a later
phase). Its keys are then missing from the checkpoint, and the strict check refused a checkpoint that is
exactly what was saved; ``strict=False`` kept the zero-step state the template made, which the saved
optimizer did not have either.

Which parameters had no state is decided from the checkpoint alone, never from missing keys by
themselves: the checkpoint's optimizer ``param_groups`` (their ``params`` lists of parameter names, read
weights-only) name the parameter, and no ``<section>.state.<fqn>.*`` key exists. Only then is the
parameter's state dropped from the template (nothing loaded for it, nothing missing), and the optimizer
is loaded without a state for it, as ``Optimizer.load_state_dict`` of the saved state dict would leave
it. A parameter the saved groups do not name stays in the template: missing, a StateMismatchError.

The ``params`` lists are read from their byte ranges before the load, to shape it (the files were
verified just before); the load then reads the same items again with every byte checked against the
manifest, and :func:`check_named` confirms the checked lists name every parameter dropped.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from safepoint.errors import CorruptCheckpointError
from safepoint.restore.compat import file_ranges
from safepoint.state import OPTIMIZER, OPTIMIZERS
from safepoint.store.reader import weights_only_load

_STATE, _GROUPS, _PARAMS = "state", "param_groups", "params"

Dropped = dict[tuple[str, ...], frozenset[str]]
"""Per optimizer section of the template (``("optimizer",)``, ``("optimizers", "ema")``): the parameter
names whose state was dropped."""


def drop_stateless(template: dict[str, Any], metadata: Metadata, layout: Any, step: int) -> Dropped:
    """Remove from ``template``'s model-keyed optimizer sections the state of every parameter the
    checkpoint's param groups name but hold no state for (module docstring); ``step``'s files are read
    from ``layout`` (a local root, a per-node view, an object store). Returns what was removed."""
    read = file_ranges(layout, step)
    dropped: Dropped = {}
    saved = metadata.state_dict_metadata
    for path, optim_sd in _sections(template):
        prefix = ".".join(path) + "."
        # Every restore comes here: first one lookup per key of the template, as the strict check does (a
        # parameter the checkpoint holds any of the template's keys for had a state); the whole key list
        # is scanned only when some parameter has none of them.
        maybe = [
            fqn
            for fqn, values in optim_sd[_STATE].items()
            if not (isinstance(values, dict) and any(f"{prefix}{_STATE}.{fqn}.{k}" in saved for k in values))
        ]
        if not maybe:
            continue
        with_state = _saved_state_fqns(metadata, path, prefix)
        candidates = [fqn for fqn in maybe if fqn not in with_state]
        if not candidates:
            continue
        named = _saved_names(metadata, prefix, read)
        gone = frozenset(fqn for fqn in candidates if fqn in named)
        for fqn in gone:
            del optim_sd[_STATE][fqn]
        if gone:
            dropped[path] = gone
    return dropped


def check_named(
    step: int, template: dict[str, Any], dropped: Dropped, error: type[CorruptCheckpointError]
) -> None:
    """After the load: the param groups loaded (every byte checked against the manifest) name every
    parameter whose state :func:`drop_stateless` dropped on the strength of the bytes read before it;
    else ``error`` (the file changed while it was read: the state may be partly overwritten)."""
    for path, gone in dropped.items():
        optim_sd: Any = template
        for p in path:
            optim_sd = optim_sd.get(p) if isinstance(optim_sd, dict) else None
        named = _names_in(optim_sd.get(_GROUPS) if isinstance(optim_sd, dict) else None)
        if not gone <= named:
            raise error(
                step,
                None,
                f"{'.'.join(path)}.param_groups changed while the checkpoint was read "
                f"(no longer naming {sorted(gone - named)[:4]})",
            )


def _sections(template: dict[str, Any]) -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    """The model-keyed optimizer state dicts in ``template`` (a template-free optimizer is built from the
    checkpoint's own keys: nothing to drop there)."""
    found: list[tuple[tuple[str, ...], Any]] = [((OPTIMIZER,), template.get(OPTIMIZER))]
    named = template.get(OPTIMIZERS)
    if isinstance(named, dict):
        found += [((OPTIMIZERS, name), sd) for name, sd in named.items()]
    return [
        (path, sd)
        for path, sd in found
        if isinstance(sd, dict) and isinstance(sd.get(_STATE), dict) and isinstance(sd.get(_GROUPS), list)
    ]


def _saved_state_fqns(metadata: Metadata, path: tuple[str, ...], prefix: str) -> set[str]:
    """The parameter names the checkpoint holds optimizer state for under ``path``. DCP records each key's
    path (``planner_data``): ``("optimizer", "state", "a.weight", "exp_avg")``; a name may hold dots."""
    out: set[str] = set()
    mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    state_prefix = f"{prefix}{_STATE}."
    n = len(path)
    for key in metadata.state_dict_metadata:
        if not key.startswith(state_prefix):
            continue
        where = mappings.get(key)
        if isinstance(where, tuple) and len(where) > n + 1 and tuple(where[: n + 1]) == (*path, _STATE):
            out.add(str(where[n + 1]))
        else:  # no recorded path: every prefix of the rest could be the name (never drops wrongly)
            parts = key[len(state_prefix) :].split(".")
            out.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return out


def _saved_names(metadata: Metadata, prefix: str, read: Callable[[str, int, int], bytes]) -> set[str]:
    """Every parameter name the checkpoint's param groups under ``prefix`` list (``param_groups.<i>.params``,
    one record each, read weights-only)."""
    keys = [
        k
        for k, md in metadata.state_dict_metadata.items()
        if isinstance(md, BytesStorageMetadata)
        and k.startswith(f"{prefix}{_GROUPS}.")
        and k.endswith(f".{_PARAMS}")
        and k[len(prefix) + len(_GROUPS) + 1 : -len(_PARAMS) - 1].isdigit()
    ]
    if not keys:
        return set()
    where = {index.fqn: info for index, info in metadata.storage_data.items() if index.fqn in keys}
    lists = []
    for key in keys:
        info = where.get(key)
        if info is None or info.transform_descriptors:
            continue  # not readable as one plain record here: names nothing (the mismatch stands)
        raw = read(info.relative_path, info.offset, info.length)
        lists.append(weights_only_load(io.BytesIO(raw), key))
    return _names_in([{_PARAMS: v} for v in lists])


def _names_in(groups: Any) -> set[str]:
    out: set[str] = set()
    if not isinstance(groups, list):
        return out
    for group in groups:
        params = group.get(_PARAMS) if isinstance(group, dict) else None
        if isinstance(params, list):
            out.update(p for p in params if isinstance(p, str))
    return out
