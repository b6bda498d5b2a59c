"""Non-strict and partial restores: which saved key loads into which key of the state, and what did not.

``restore(state, strict=False, ignore=[...], remap=fn)``: every key of the state (flattened as DCP names
them: ``model.fc.weight``, ``optimizer.state.fc.weight.exp_avg``, ``extra.rank_0.tokens``) is matched to
a saved key, by name or through ``remap`` (saved key -> state key, None drops it). What has no match, or
matches with another shape, or matches an ``ignore`` pattern, is left as it is; with ``strict=True`` (the
default) anything but an ignored key missing or unexpected is an error, as it always was. The outcome is a
:class:`RestoreReport` (``CheckpointManager.last_restore``), logged when something was not loaded.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from safepoint.data.own_keys import set_at
from safepoint.errors import StateMismatchError

_RANK_SEGMENT = re.compile(r"^([^.]+)\.rank_[0-9]+\.")
_SHOW = 8
STRICT_HINT = ". restore(strict=False) loads what matches; ignore=[...] skips keys; remap= renames them"


def plain_key(key: str) -> str:
    """``key`` without its rank segment (``extra.rank_1.n`` is ``extra.n``)."""
    return _RANK_SEGMENT.sub(r"\1.", key)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Selection:
    """What ``restore`` was asked to load (its keyword arguments, checked)."""

    strict: bool = True
    """Unmatched keys are an error (True) or reported and left as they are (False)."""
    ignore: tuple[str, ...] = ()
    """fnmatch patterns over state keys (``optimizer.*``, ``model.head.*``, ``extra.n``): never loaded."""
    remap: Callable[[str], str | None] | None = None
    """Saved key -> state key (None: drop the saved key); applied before matching."""

    def __post_init__(self) -> None:
        if not isinstance(self.strict, bool):
            raise ValueError(f"restore(strict=...) must be a bool, got {self.strict!r}")
        if isinstance(self.ignore, str) or not all(isinstance(p, str) and p for p in self.ignore):
            raise ValueError(f"restore(ignore=...) must be a list of key patterns, got {self.ignore!r}")
        if self.remap is not None and not callable(self.remap):
            raise ValueError(
                f"restore(remap=...) must be callable (saved key -> state key), got {self.remap!r}"
            )

    @classmethod
    def of(
        cls, strict: bool, ignore: Iterable[str] | None, remap: Callable[[str], str | None] | None
    ) -> Selection:
        if isinstance(ignore, str):
            raise ValueError(f"restore(ignore=...) must be a list of key patterns, got the string {ignore!r}")
        return cls(strict=strict, ignore=tuple(ignore or ()), remap=remap)

    @property
    def default(self) -> bool:
        return self.strict and not self.ignore and self.remap is None

    def ignores(self, key: str) -> bool:
        """``key`` matches a pattern as it is or without its rank (``extra.rank_1.n`` is ``extra.n``)."""
        plain = plain_key(key)
        return any(fnmatch.fnmatchcase(key, p) or fnmatch.fnmatchcase(plain, p) for p in self.ignore)

    def ignores_section(self, section: str) -> bool:
        """A pattern naming a whole section (``optimizer``, ``optimizer.*``, ``modules.ema.*``)."""
        return any(
            fnmatch.fnmatchcase(section, p) or fnmatch.fnmatchcase(section + ".\0", p) for p in self.ignore
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RestoreReport:
    """What the last ``restore`` loaded and what it left as it was (``CheckpointManager.last_restore``)."""

    step: int
    """The checkpoint's step."""
    source: str
    """Where it was read from: the root, or the ``init_from`` of a warm start."""
    warm_start: bool = False
    """Loaded from ``init_from`` (the job's own root had no checkpoint)."""
    loaded: int = 0
    """How many keys were loaded."""
    missing: tuple[str, ...] = ()
    """Keys of the state the checkpoint does not hold (sections too, as ``optimizer``): left as they were."""
    unexpected: tuple[str, ...] = ()
    """Keys in the checkpoint that no key of the state takes: not loaded."""
    mismatched: tuple[str, ...] = ()
    """Keys held with another shape or type: left as they were."""
    ignored: tuple[str, ...] = ()
    """Keys (or whole sections) matching an ``ignore`` pattern: left as they were."""
    remapped: tuple[tuple[str, str], ...] = ()
    """(saved key, state key) pairs that ``remap`` renamed."""
    files: tuple[tuple[str, str], ...] = ()
    """With per-node local tiers: (file, where this rank read it from: "local" for its node's own copy,
    "durable" for the durable tier) for each file this rank read; empty otherwise."""

    @property
    def complete(self) -> bool:
        """Every key of the state was loaded and every saved key used."""
        return not (self.missing or self.unexpected or self.mismatched or self.ignored)

    def describe(self) -> str:
        parts = [
            f"{len(getattr(self, f))} {f}: {_few(list(getattr(self, f)))}"
            for f in _FIELDS
            if getattr(self, f)
        ]
        return "; ".join(parts) or "everything matched"


_FIELDS = ("missing", "unexpected", "mismatched", "ignored")


@dataclasses.dataclass
class Plan:
    """The dict DCP loads (saved key -> the state's object) and how to put the result back."""

    to_load: dict[str, Any]
    pairs: list[tuple[str, str]]  # (state key, saved key)
    template: dict[str, Any]
    mapping: Any
    report: dict[str, list[Any]]

    def put_back(self) -> dict[str, Any]:
        """The template with what DCP loaded (tensors were loaded in place; other values replaced).

        Written into the template where each key came from, not rebuilt from the flattened keys: DCP's
        flattening has no key for an empty container (``{}``, ``[{}]``), so a rebuilt dict lost them: a
        LambdaLR of a ``functools.partial`` (``lr_lambdas == [{}]``) then failed to load, and a momentum-free
        SGD's ``state == {}`` (tests/restore/test_plan_keeps_values.py). The full path loads in place too.
        At the template's own keys (data/own_keys.py): an int-keyed dict's value is not written beside it."""
        for target, source in self.pairs:
            set_at(self.template, self.mapping[target], self.to_load[source])
        return self.template


def plan(
    step: int, template: dict[str, Any], metadata: Metadata, prefixes: tuple[str, ...], sel: Selection
) -> Plan:
    """Match ``template``'s keys with the saved ones; StateMismatchError if ``sel.strict`` and any is off."""
    flat, mapping = flatten_state_dict(template)
    saved = metadata.state_dict_metadata
    sources: dict[str, str] = {}
    renamed: list[tuple[str, str]] = []
    collided: dict[str, list[str]] = {}
    for key in saved:
        target = sel.remap(key) if sel.remap is not None else key
        if target is None:
            continue
        if not isinstance(target, str):
            raise ValueError(f"restore(remap=...) returned {target!r} for {key!r}; expected a key or None")
        if target in flat and target in sources and not sel.ignores(target):
            collided.setdefault(target, [sources[target]]).append(key)
        elif target in flat and target not in sources:
            sources[target] = key
            if target != key:
                renamed.append((key, target))
    if collided:  # whichever came first in .metadata would load, silently: never guess
        raise StateMismatchError(_collisions(step, collided))
    report: dict[str, list[Any]] = {f: [] for f in _FIELDS}
    report["remapped"] = renamed
    to_load: dict[str, Any] = {}
    pairs: list[tuple[str, str]] = []
    for target, value in flat.items():
        source = sources.get(target)
        if sel.ignores(target):
            report["ignored"].append(target)
        elif source is None:
            report["missing"].append(target)
        elif (why := _mismatch(value, saved[source])) is not None:
            report["mismatched"].append(f"{target}: {why}")
        else:
            to_load[source] = value
            pairs.append((target, source))
    used = set(sources.values())
    for key in saved:
        if key.startswith(prefixes) and key not in used:
            target = sel.remap(key) if sel.remap is not None else key
            if target is not None and (sel.ignores(key) or sel.ignores(target)):
                continue  # counted on the state's side if the state has it; never "unexpected"
            if target is not None and target not in flat:
                report["unexpected"].append(key)
    if sel.strict and (report["missing"] or report["unexpected"] or report["mismatched"]):
        parts = [
            f"{len(report[f])} {_WHAT[f]}: {_few(report[f])}"
            for f in ("missing", "unexpected", "mismatched")
            if report[f]
        ]
        raise StateMismatchError(
            f"checkpoint step {step} does not match the state being restored (wrong model or config?): "
            + "; ".join(parts)
            + STRICT_HINT
        )
    return Plan(to_load, pairs, template, mapping, report)


_WHAT = {
    "missing": "missing from the checkpoint",
    "unexpected": "in the checkpoint but not in the target",
    "mismatched": "mismatched",
}


def _collisions(step: int, collided: dict[str, list[str]]) -> str:
    target = min(collided)
    keys = " and ".join(repr(k) for k in sorted(collided[target]))
    more = f" (and {len(collided) - 1} more keys of the state)" if len(collided) > 1 else ""
    return (
        f"checkpoint step {step}: restore(remap=...) maps {keys} onto {target!r}{more}; only one saved "
        "key can load into a key of the state: return None for the others"
    )


def _mismatch(value: Any, md: Any) -> str | None:
    if isinstance(value, torch.Tensor):
        if not isinstance(md, TensorStorageMetadata):
            return "checkpoint holds a non-tensor value, the target is a tensor"
        if tuple(md.size) != tuple(value.shape):
            return f"checkpoint shape {tuple(md.size)} vs target {tuple(value.shape)}"
        return None
    if isinstance(md, TensorStorageMetadata):
        return f"checkpoint holds a tensor, the target is {type(value).__name__}"
    return None


def _few(items: list[str]) -> str:
    shown = ", ".join(sorted(items)[:_SHOW])
    return shown + (f", ... (+{len(items) - _SHOW} more)" if len(items) > _SHOW else "")
