"""capture/apply: TrainState <-> a DCP state dict.

Top-level sections are the constants below. Rank-local sections (RNG, data position, extra) are keyed by
rank (``rng.rank_1....``) because DCP deduplicates values that look replicated across ranks: without the
key, one rank's RNG would silently stand in for all. Named sections (``modules``, ``optimizers``,
``objects``) are keyed by the user's name (``modules.ema.tok.weight``): each name is a section of its own
in the manifest (``modules.ema``), so adding one later leaves every older checkpoint loadable, and
``model``/``optimizer`` keep the keys they always had.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from safepoint.data import rng
from safepoint.data.module_state import module_state_dicts, set_module_state
from safepoint.data.optim_load import in_order
from safepoint.data.plain import PlainState, load_own_optimizer_sd, load_stateful, own_optimizer_sd
from safepoint.data.restorable import restorable
from safepoint.data.sharded import check_not_sharded

MODEL = "model"
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
DATALOADER = "dataloader"
RNG = "rng"
EXTRA = "extra"
MODULES = "modules"
OPTIMIZERS = "optimizers"
OBJECTS = "objects"
SECTIONS = (MODEL, OPTIMIZER, SCHEDULER, DATALOADER, RNG, EXTRA, MODULES, OPTIMIZERS, OBJECTS)
PER_RANK_SECTIONS = frozenset({DATALOADER, RNG, EXTRA})
NAMED_SECTIONS = (MODULES, OPTIMIZERS, OBJECTS)
KEYED_SECTIONS = PER_RANK_SECTIONS | frozenset(NAMED_SECTIONS)
"""Sections whose value is a dict of independent entries (by rank or by name): one entry's keys are never
"unexpected" for another's."""
RANK_PREFIX = "rank_"
_NAME = re.compile(r"[A-Za-z0-9_-]+\Z")  # no ".": DCP flattens nested keys with dots


def rank_key(rank: int) -> str:
    return f"{RANK_PREFIX}{rank}"


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainState:
    """Everything a training loop needs to continue exactly where it stopped."""

    model: nn.Module | None = None
    """Any nn.Module: plain, DDP, FSDP2 (``fully_shard``) or FSDP1. Saved sharded, without gathering."""
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None
    """One optimizer or a list. With ``model``: keyed by parameter names (sharded like the model); without:
    its own ``state_dict()``, restored into a fresh optimizer too (template-free, see ``free_parts``)."""
    scheduler: Any = None
    """Any object with ``state_dict()``/``load_state_dict()`` (LR scheduler); replicated across ranks."""
    dataloader: Any = None
    """Stateful data position (e.g. ``safepoint.ResumableSampler``); saved per rank."""
    extra: dict[str, Any] | None = None
    """Stateful objects and JSON-able values, saved per rank and restored into this same dict."""
    rng: bool = True
    """Save and restore Python, NumPy, torch CPU and CUDA RNG state, per rank."""
    modules: dict[str, nn.Module] | None = None
    """Named modules beside ``model`` (an EMA copy, a GAN's discriminator, a teacher), each saved sharded
    exactly like ``model``, under ``modules.<name>.``. A name added later is left as initialised (with a
    warning) when an older checkpoint is restored."""
    optimizers: dict[str, torch.optim.Optimizer | list[torch.optim.Optimizer]] | None = None
    """The optimizers of named modules, by the module's name (saved under ``optimizers.<name>.``)."""
    objects: dict[str, Any] | None = None
    """Named Stateful objects replicated across ranks (like ``scheduler``), under ``objects.<name>.``."""

    def __post_init__(self) -> None:
        self._check_named()
        if self.model is not None and not isinstance(self.model, nn.Module):
            raise ValueError(f"TrainState(model=...) must be an nn.Module, got {type(self.model).__name__}")
        if self.optimizer is not None:
            opts = self.optimizer if isinstance(self.optimizer, (list, tuple)) else [self.optimizer]
            for opt in opts:
                if not isinstance(opt, torch.optim.Optimizer):
                    raise ValueError(
                        f"TrainState(optimizer=...) must be an Optimizer or a list of them, got "
                        f"{type(opt).__name__}"
                    )
        for name in (SCHEDULER, DATALOADER):
            obj = getattr(self, name)
            if obj is not None and not isinstance(obj, Stateful):
                raise ValueError(
                    f"TrainState({name}=...) needs state_dict() and load_state_dict(); "
                    f"{type(obj).__name__} has not"
                )
        if self.extra is not None:
            if not isinstance(self.extra, dict):
                raise ValueError("TrainState(extra=...) must be a dict")
            for k, v in self.extra.items():
                if not isinstance(k, str):
                    raise ValueError(f"TrainState(extra=...) keys must be strings, got {k!r}")
                _check_extra_value(k, v)
                check_not_sharded(k, v)

    def _check_named(self) -> None:
        for field in NAMED_SECTIONS:
            named = getattr(self, field)
            if named is None:
                continue
            if not isinstance(named, dict):
                raise ValueError(f"TrainState({field}=...) must be a dict of name -> object")
            for name, obj in named.items():
                if not isinstance(name, str) or not _NAME.match(name):
                    raise ValueError(
                        f"TrainState({field}=...): name {name!r} must be letters, digits, '_' or '-' (it is "
                        "part of every saved key)"
                    )
                if field == MODULES and not isinstance(obj, nn.Module):
                    raise ValueError(f"TrainState(modules={{{name!r}: ...}}) must be an nn.Module")
                if field == OPTIMIZERS:
                    if name not in (self.modules or {}):
                        raise ValueError(
                            f"TrainState(optimizers={{{name!r}: ...}}) needs modules={{{name!r}: ...}} too "
                            "(optimizer state is keyed by the module's parameter names)"
                        )
                    if not all(isinstance(o, torch.optim.Optimizer) for o in _as_list(obj)):
                        raise ValueError(
                            f"TrainState(optimizers={{{name!r}: ...}}) must be an Optimizer or a list of them"
                        )
                if field == OBJECTS and not isinstance(obj, Stateful):
                    raise ValueError(
                        f"TrainState(objects={{{name!r}: ...}}) needs state_dict() and load_state_dict(); "
                        f"{type(obj).__name__} has not"
                    )

    def _named_optimizers(self, name: str) -> list[torch.optim.Optimizer]:
        return _as_list((self.optimizers or {}).get(name))

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        if self.optimizer is None:
            return []
        if isinstance(self.optimizer, torch.optim.Optimizer):
            return [self.optimizer]
        return list(self.optimizer)

    def sections(self) -> list[str]:
        present = {
            MODEL: self.model is not None,
            OPTIMIZER: self.optimizer is not None,
            SCHEDULER: self.scheduler is not None,
            DATALOADER: self.dataloader is not None,
            RNG: self.rng,
            EXTRA: bool(self.extra),
        }
        named = [f"{MODULES}.{n}" for n in self.modules or {}]
        named += [f"{OPTIMIZERS}.{n}" for n in self.optimizers or {}]
        named += [f"{OBJECTS}.{n}" for n in self.objects or {}]
        return [s for s in SECTIONS if present.get(s)] + named

    # ---- capture -------------------------------------------------------------------------------------

    def capture(self, rank: int) -> dict[str, Any]:
        """The DCP state dict for a save. Tensors alias live state: stage or write before training goes on."""
        sd: dict[str, Any] = {}
        if self.model is not None:
            model_sd, optim_sd = module_state_dicts(self.model, self._optimizers(), as_saved=True)
            sd[MODEL] = model_sd
            if self.optimizer is not None:
                sd[OPTIMIZER] = optim_sd
        elif self.optimizer is not None:
            sd[OPTIMIZER] = own_optimizer_sd(self.optimizer)
        if self.scheduler is not None:
            sd[SCHEDULER] = self.scheduler.state_dict()
        if self.dataloader is not None:
            sd[DATALOADER] = {rank_key(rank): self.dataloader.state_dict()}
        if self.rng:
            sd[RNG] = {rank_key(rank): rng.capture_rng()}
        if self.extra:
            sd[EXTRA] = {rank_key(rank): _capture_extra(self.extra)}
        sd.update(self._capture_named(self.sections(), as_saved=True))
        checked: dict[str, Any] = restorable(sd)
        return checked

    # ---- restore -------------------------------------------------------------------------------------

    def load_template(self, sections: Iterable[str], sources: dict[str, int], rank: int) -> dict[str, Any]:
        """A state dict shaped like what was saved, for DCP to load into in place.

        ``sources`` maps each per-rank section to the saved rank whose entry this rank reads.
        """
        sd: dict[str, Any] = {}
        wanted = set(sections)
        # The optimizer loads without the weights too (``ignore=["model"]``): its state is keyed by the
        # parameters' names, which the model gives whether its weights load or not.
        if (MODEL in wanted or OPTIMIZER in wanted) and self.model is not None:
            model_sd, optim_sd = module_state_dicts(self.model, self._optimizers())
            if MODEL in wanted:
                sd[MODEL] = model_sd
            if OPTIMIZER in wanted and self.optimizer is not None:
                sd[OPTIMIZER] = optim_sd
        elif OPTIMIZER in wanted:
            sd[OPTIMIZER] = {}  # template-free (free_parts): what was saved is loaded
        if SCHEDULER in wanted:
            sd[SCHEDULER] = self.scheduler.state_dict()
        if DATALOADER in wanted:
            sd[DATALOADER] = {rank_key(sources[DATALOADER]): _loader_template(self.dataloader)}
        if RNG in wanted:
            sd[RNG] = {rank_key(sources[RNG]): rng.capture_rng()}
        if EXTRA in wanted and self.extra:
            sd[EXTRA] = {rank_key(sources[EXTRA]): _capture_extra(self.extra)}
        sd.update(self._capture_named(wanted))
        return sd

    def free_parts(self, sections: Iterable[str], sources: dict[str, int]) -> list[tuple[str, ...]]:
        """Where in ``load_template``'s dict the saved keys, not the live object's, say what is loaded: a
        PlainState, and an optimizer not keyed by a model (a fresh one has an empty ``state``)."""
        free = (PlainState, torch.optim.Optimizer)
        wanted, parts = set(sections), list[tuple[str, ...]]()
        if OPTIMIZER in wanted and self.model is None:
            parts.append((OPTIMIZER,))
        parts += [(OBJECTS, n) for n, o in (self.objects or {}).items() if isinstance(o, free)]
        parts = [p for p in parts if ".".join(p) in wanted or p == (OPTIMIZER,)]
        if EXTRA in wanted:
            parts += [(EXTRA, rank_key(sources[EXTRA]), k) for k, v in (self.extra or {}).items()
                      if isinstance(v, free)]  # fmt: skip
        return parts

    def _capture_named(self, wanted: Iterable[str], as_saved: bool = False) -> dict[str, Any]:
        """``{"modules": {name: sd}, "optimizers": {name: sd}, "objects": {name: sd}}`` for the named sections
        in ``wanted`` (``"modules.ema"``, ...); each module with its own optimizers, as ``model`` is."""
        wanted = set(wanted)
        out: dict[str, dict[str, Any]] = {}
        for name, module in (self.modules or {}).items():
            with_optim = f"{OPTIMIZERS}.{name}" in wanted and name in (self.optimizers or {})
            if f"{MODULES}.{name}" not in wanted and not with_optim:
                continue
            model_sd, optim_sd = module_state_dicts(module, self._named_optimizers(name), as_saved=as_saved)
            if f"{MODULES}.{name}" in wanted:
                out.setdefault(MODULES, {})[name] = model_sd
            if with_optim:
                out.setdefault(OPTIMIZERS, {})[name] = optim_sd
        for name, obj in (self.objects or {}).items():
            if f"{OBJECTS}.{name}" in wanted:
                out.setdefault(OBJECTS, {})[name] = obj.state_dict()
        return out

    def apply(
        self,
        sd: dict[str, Any],
        sources: dict[str, int],
        derived_rng_seed: int | None,
        in_place: frozenset[str] = frozenset(),
    ) -> None:
        """Push loaded values back into the live objects. ``in_place``: the module sections (``model``,
        ``modules.<name>``) whose live tensors already hold what was loaded (restore/in_place.py): their
        ``load_state_dict`` is skipped, their optimizers are still loaded."""
        # Optimizers only when their state was loaded (an imported checkpoint holds weights only); weights
        # only when they were (an empty model state dict makes set_state_dict load the optimizer alone).
        if (MODEL in sd or OPTIMIZER in sd) and self.model is not None:
            _set_state(
                self.model,
                self._optimizers() if OPTIMIZER in sd else [],
                {} if MODEL in in_place else sd.get(MODEL, {}),
                sd.get(OPTIMIZER, {}),
            )
        loaded_optims, loaded_modules = sd.get(OPTIMIZERS, {}), sd.get(MODULES, {})
        for name in loaded_modules.keys() | loaded_optims.keys():
            _set_state(
                (self.modules or {})[name],
                self._named_optimizers(name) if name in loaded_optims else [],
                {} if f"{MODULES}.{name}" in in_place else loaded_modules.get(name, {}),
                loaded_optims.get(name, {}),
            )
        for name, obj_sd in sd.get(OBJECTS, {}).items():
            load_stateful((self.objects or {})[name], obj_sd)
        if OPTIMIZER in sd and self.model is None and self.optimizer is not None:
            load_own_optimizer_sd(self.optimizer, sd[OPTIMIZER])
        if SCHEDULER in sd:
            self.scheduler.load_state_dict(sd[SCHEDULER])
        if DATALOADER in sd:
            self.dataloader.load_state_dict(sd[DATALOADER][rank_key(sources[DATALOADER])])
        if EXTRA in sd and self.extra is not None:
            loaded = sd[EXTRA][rank_key(sources[EXTRA])]
            for k, v in loaded.items():
                current = self.extra.get(k)
                if isinstance(current, Stateful):
                    load_stateful(current, v)
                else:
                    self.extra[k] = v
        if RNG in sd:
            rng.restore_rng(sd[RNG][rank_key(sources[RNG])])
            if derived_rng_seed is not None:
                rng.seed_all(derived_rng_seed)


def _set_state(
    module: nn.Module, optims: list[torch.optim.Optimizer], model_sd: dict[str, Any], optim_sd: Any
) -> None:
    """``set_state_dict`` (an empty ``model_sd``: in place); a plain optimizer after it, in linear time."""
    load = in_order(module, optims, optim_sd) if optims else None
    optims, optim_sd = ([], {}) if load is not None else (optims, optim_sd)
    if model_sd or optims:
        set_module_state(module, optims, model_sd, optim_sd)
    if load is not None:
        load()


def _check_extra_value(key: str, value: Any) -> None:
    if isinstance(value, (Stateful, torch.Tensor)):
        return
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"TrainState(extra={{{key!r}: ...}}) must be a Stateful object, a tensor or a JSON-able value; "
            f"got {type(value).__name__}"
        ) from None


def _as_list(opt: Any) -> list[torch.optim.Optimizer]:
    if opt is None:
        return []
    return [opt] if isinstance(opt, torch.optim.Optimizer) else list(opt)


def _capture_extra(extra: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in extra.items():
        _check_extra_value(k, v)
        out[k] = v.state_dict() if isinstance(v, Stateful) else v
    return out


def _loader_template(loader: Any) -> Any:
    """The loader's ``state_dict()``, its ``generator=`` left as it was: torchdata's StatefulDataLoader
    makes an iterator to answer it on a fresh loader, which draws a worker base seed from the generator,
    one more than the uninterrupted run drew (the next epoch's workers were seeded differently: found by
    the GPU FSDP2 run, tests/data/test_loader_restore.py)."""
    generator = getattr(loader, "generator", None)
    if not isinstance(generator, torch.Generator):
        return loader.state_dict()
    before = generator.get_state()
    template = loader.state_dict()
    generator.set_state(before)
    return template
