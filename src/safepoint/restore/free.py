"""Template-free parts of a restore: what the checkpoint saved, not what the live object holds, says which
keys load (``TrainState.free_parts``: a PlainState, an optimizer not keyed by a model). Each part of the
template is rebuilt from the checkpoint's own key list, ``.metadata`` (read through the manifest check), or
from the rank file that holds it; the bytes are then read like any other restore's: checked against the
manifest as they are read, non-tensors with ``torch.load(weights_only=True)``."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from safepoint.errors import StateMismatchError
from safepoint.restore.partial import Plan

_ROOT = "\x00root"


def fill_free(
    template: dict[str, Any], parts: list[tuple[str, ...]], metadata: Metadata, rank_values: dict[str, Any]
) -> None:
    """Replace each part of ``template`` (a path into it) with the saved subtree: tensors allocated as
    ``.metadata`` describes them, non-tensors as placeholders that the load replaces; a part kept in a rank
    file (``rank_values``, already read and checked) is taken from the file."""
    for part in parts:
        sub = _get(rank_values, part) if part[0] in rank_values else materialize(metadata, part)
        _put(template, part, sub)


def materialize(metadata: Metadata, part: tuple[str, ...]) -> dict[str, Any]:
    """The nested dict of every saved key under ``part`` (``("objects", "x")``: ``objects.x.*``)."""
    prefix = ".".join(part) + "."
    root: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if not key.startswith(prefix):
            continue
        value: Any = md
        if isinstance(md, TensorStorageMetadata):
            value = torch.empty(md.size, dtype=md.properties.dtype)
        path = (metadata.planner_data or {}).get(key)
        rest = tuple(path[len(part) :]) if path is not None else tuple(key[len(prefix) :].split("."))
        set_element(root, (_ROOT, *rest), value)
    sub: dict[str, Any] = root.get(_ROOT, {})
    return sub


def check_loads_something(step: int, matched: Plan) -> None:
    """``restore(strict=False)`` that would load nothing is an error: a step returned with nothing loaded
    (the wrong model, a renamed module) would train from scratch while the run believes it resumed."""
    if not matched.pairs:
        found = ", ".join(f"{len(v)} {k}" for k, v in matched.report.items() if v) or "nothing saved"
        raise StateMismatchError(
            f"checkpoint step {step}: restore(strict=False) matched no key of the state ({found}); "
            "nothing would be loaded. Check the model and the key names (remap= renames saved keys)"
        )


def _get(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    for p in path:
        tree = tree.get(p, {}) if isinstance(tree, dict) else {}
    return tree


def _put(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value
