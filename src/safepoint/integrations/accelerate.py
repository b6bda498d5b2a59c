"""Hugging Face Accelerate: what ``accelerator.save_state`` saves, saved by safepoint.

    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    loader = ReplayLoader(loader)
    state = accelerate_state(accelerator, loader)
    with safepoint.CheckpointManager(root, save_every_steps=100, ...) as mgr:
        step = mgr.restore(state)
        ...  # for batch in loader: ...; step += 1; mgr.maybe_save(step, state)

Why a state builder, not ``register_save_state_pre_hook``: a hook runs inside ``accelerator.save_state``,
which still writes its own files into its own folder (deleting the oldest first, checking nothing on load);
a hook can add files beside them, not make them atomic, verified or asynchronous. Reading what the
accelerator prepared (its models, optimizers, schedulers, scaler, registered objects and step counter, the
lists ``save_state`` itself reads) and handing them to one :class:`~safepoint.TrainState` gives the training
loop the manager's ordinary calls: async saves, the newest intact checkpoint on restore, the preemption save.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from safepoint.data.replay import ReplayLoader
from safepoint.state import TrainState

__all__ = ["ReplayLoader", "accelerate_state"]

SCALER = "scaler"
COUNTERS = "accelerator"
SCHEDULER_PREFIX = "scheduler_"
REGISTERED_PREFIX = "registered_"
MODEL_PREFIX = "model_"


class _Counters:
    """The accelerator's gradient-accumulation step (``accelerator.step``), which ``save_state`` keeps too."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.accelerator.step = int(state_dict["step"])


def accelerate_state(
    accelerator: Any,
    loader: ReplayLoader | None = None,
    *,
    extra: dict[str, Any] | None = None,
    rng: bool = True,
) -> TrainState:
    """A TrainState holding everything ``accelerator.prepare`` and ``register_for_checkpointing`` gave it.

    Call it after ``accelerator.prepare``. The first prepared model is ``model``, others ``model_1``, ...
    (named modules); each optimizer goes with the model whose parameters it steps. Schedulers, the gradient
    scaler, registered objects and the accumulation step are named objects. ``loader``: the prepared
    training DataLoader wrapped in :class:`ReplayLoader`, so a resume continues at the exact batch.
    ``rng``: every process saves and restores its own Python, NumPy and torch RNG.
    """
    models = [m for m in accelerator._models if isinstance(m, nn.Module)]
    if not models:
        raise ValueError("accelerate_state: the accelerator prepared no model ; prepare one first")
    if loader is not None and not isinstance(loader, ReplayLoader):
        raise ValueError(
            "accelerate_state(loader=...) must be a ReplayLoader(prepared_dataloader), got "
            f"{type(loader).__name__}"
        )
    by_model: dict[int, list[Any]] = {}
    for opt in accelerator._optimizers:
        inner = getattr(opt, "optimizer", opt)  # AcceleratedOptimizer wraps the user's optimizer
        by_model.setdefault(_owner(inner, models), []).append(inner)
    objects: dict[str, Any] = {COUNTERS: _Counters(accelerator)}
    schedulers = list(accelerator._schedulers)
    for i, sched in enumerate(schedulers[1:], start=1):
        objects[f"{SCHEDULER_PREFIX}{i}"] = sched
    if accelerator.scaler is not None:
        objects[SCALER] = accelerator.scaler
    for i, obj in enumerate(accelerator._custom_objects):
        objects[f"{REGISTERED_PREFIX}{i}"] = obj
    named = {f"{MODEL_PREFIX}{i}": m for i, m in enumerate(models) if i > 0}
    return TrainState(
        model=models[0],
        optimizer=_one_or_list(by_model.get(0)),
        scheduler=schedulers[0] if schedulers else None,
        dataloader=loader,
        extra=extra,
        rng=rng,
        modules=named or None,
        optimizers={f"{MODEL_PREFIX}{i}": _one_or_list(o) for i, o in by_model.items() if i > 0} or None,
        objects=objects,
    )


def _owner(optimizer: Any, models: list[nn.Module]) -> int:
    """The index of the model whose parameters ``optimizer`` steps (its state is keyed by their names)."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for i, model in enumerate(models):
        if any(id(p) in params for p in model.parameters()):
            return i
    raise ValueError("accelerate_state: an optimizer steps no parameter of any prepared model")


def _one_or_list(opts: list[Any] | None) -> Any:
    if not opts:
        return None
    return opts[0] if len(opts) == 1 else opts
