"""torchtitan 0.3: a checkpointer its config selects, saving through safepoint.

    from safepoint.integrations.torchtitan import SafepointCheckpointManager

    config.checkpoint = SafepointCheckpointManager.Config(enable=True, folder="checkpoint", interval=500)

The trainer builds it with ``config.checkpoint.build(...)`` exactly as it builds its own DCP checkpointer,
calls ``load()`` before the first step, ``save(step, last_step=...)`` after each step,
``maybe_wait_for_staging()`` before the optimizer steps and ``close()`` at the end.

Why a ``BaseCheckpointManager`` subclass: the trainer's ``checkpoint`` field is typed
``BaseCheckpointManager.Config`` and ``Configurable`` builds whatever class declared the chosen ``Config``,
so the trainer code is unchanged (``torch_checkpointing.py`` in torchtitan plugs in the same way). What the
trainer hands over (its model parts, ``OptimizersContainer``, ``LRSchedulersContainer``, dataloader and
``states={"train_state": trainer}``) becomes one :class:`~safepoint.TrainState`, so a save is safepoint's:
async, atomic, verified, retained, and ``load()`` resumes from the newest *intact* step (torchtitan's own
picks the highest ``step-N`` folder that has a ``.metadata`` file, whatever else is missing or damaged).
"""

from __future__ import annotations

import pickle
import signal
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from torch import nn
from torchtitan.components.checkpointer.base import BaseCheckpointManager
from torchtitan.tools import filesystem

from safepoint.manager import CheckpointManager
from safepoint.options import PreemptionOptions
from safepoint.policy.keep import Keep
from safepoint.state import TrainState

__all__ = ["SafepointCheckpointManager"]

# torchtitan's own keys (components/checkpointer/base.py), what exclude_from_loading names.
TT_OPTIMIZER = "optimizer"
TT_LR_SCHEDULER = "lr_scheduler"
TT_DATALOADER = "dataloader"
PART_PREFIX = "part_"  # model parts after the first (pipeline stages): named modules of the TrainState
WORLD_SIZE = "world_size"
LOADER_STATE = "state"


class _PlainLoader:
    """torchtitan's ``ParallelAwareDataloader.state_dict()`` is ``{"dp_rank_N": pickle bytes, "world_size"}``.

    safepoint never unpickles bytes read from a checkpoint. The bytes are unpickled here, at save time, in the
    process that just made them (so nothing foreign is trusted), and saved as the plain ``StatefulDataLoader``
    state they hold; a load hands the loader bytes pickled from that verified plain state."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        raw = self.loader.state_dict()
        plain: dict[str, Any] = {}
        for key, value in raw.items():
            plain[key] = pickle.loads(value) if isinstance(value, bytes) else value
        return plain

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raw = {k: v if k == WORLD_SIZE else pickle.dumps(v) for k, v in state_dict.items()}
        self.loader.load_state_dict(raw)


class _States:
    """torchtitan's ``states`` (``{"train_state": trainer}`` and whatever else a trainer adds): Stateful
    objects, saved per rank like every process's own counters."""

    def __init__(self, states: dict[str, Any]) -> None:
        self.states = states

    def state_dict(self) -> dict[str, Any]:
        return {k: v.state_dict() for k, v in self.states.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, obj in self.states.items():
            if key not in state_dict:
                raise ValueError(f"the checkpoint has no torchtitan state {key!r}")
            obj.load_state_dict(state_dict[key])


class SafepointCheckpointManager(BaseCheckpointManager):  # type: ignore[misc]  # torchtitan is untyped
    """torchtitan's checkpointer contract (``save``, ``load``, ``maybe_wait_for_staging``, ``close``,
    ``maybe_wait_for_saving``) kept by a :class:`safepoint.CheckpointManager` on ``dump_folder/folder``."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        """torchtitan's checkpoint policies (``enable``, ``folder``, ``interval``, ``keep_latest_k``,
        ``load_step``, ``exclude_from_loading``, ``enable_first_step_checkpoint``, ``load_only``) and
        safepoint's own. The final checkpoint is a full, resumable one: the HF/export-dtype and seed options
        are refused with a one-line error rather than silently ignored."""

        async_save: bool = True
        """Stage the state to host memory and write it in the background (safepoint's ``async_save``)."""

        rng: bool = True
        """Save and restore every rank's Python, NumPy, torch CPU and CUDA RNG (torchtitan's own does not)."""

        save_on_sigterm: bool = False
        """On SIGTERM (a preemption notice), save the step the trainer finishes next and exit 143."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            refused = {
                "initial_load_path": bool(self.initial_load_path),
                "initial_load_in_hf": self.initial_load_in_hf,
                "last_save_in_hf": self.last_save_in_hf,
                "create_seed_checkpoint": self.create_seed_checkpoint,
            }
            for name, is_set in refused.items():
                if is_set:
                    raise ValueError(f"SafepointCheckpointManager does not support checkpoint.{name}")
            unknown = set(self.exclude_from_loading) - {TT_OPTIMIZER, TT_LR_SCHEDULER, TT_DATALOADER}
            if unknown:
                raise ValueError(
                    f"checkpoint.exclude_from_loading: {sorted(unknown)} cannot be excluded "
                    f"(only {TT_OPTIMIZER!r}, {TT_LR_SCHEDULER!r}, {TT_DATALOADER!r})"
                )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return  # torchtitan's contract: a disabled manager sets nothing up (base.py guards every call)
        self.save_future: Future[None] | None = None
        self.folder = filesystem.join(base_folder, config.folder)
        self.interval = config.interval
        self.load_only = config.load_only
        self.first_step = config.enable_first_step_checkpoint
        self.exclude = list(config.exclude_from_loading)
        if not model_parts:
            raise ValueError("SafepointCheckpointManager: torchtitan passed no model part")
        # What torchtitan's trainer hands its checkpointer, in its keys (states[MODEL] etc. in dcp.py).
        self.parts = list(model_parts)
        self.optimizers, self.lr_schedulers, self.dataloader = optimizers, lr_schedulers, dataloader
        self.states = states
        self.rng, self.async_save = config.rng, config.async_save
        keep = Keep(last=config.keep_latest_k) if config.keep_latest_k > 0 else None
        notices = PreemptionOptions(signals=(signal.SIGTERM,)) if config.save_on_sigterm else None
        self._manager = CheckpointManager(
            self.folder,
            save_every_steps=self.interval,
            async_save=config.async_save,
            keep=keep,
            preemption=notices,
        )
        self._state = self.train_state()  # it reads the live objects at each save: built once

    def __del__(self) -> None:
        self.close()

    def train_state(self, *, loading: bool = False) -> TrainState:
        """The TrainState this checkpointer saves; with ``loading``, without ``exclude_from_loading``."""
        skip = set(self.exclude) if loading else set()
        by_part = _optimizers_by_part(self.optimizers, self.parts)
        with_optim = TT_OPTIMIZER not in skip
        return TrainState(
            model=self.parts[0],
            optimizer=_one_or_list(by_part.get(0)) if with_optim else None,
            scheduler=self.lr_schedulers if TT_LR_SCHEDULER not in skip else None,
            dataloader=(
                _PlainLoader(self.dataloader)
                if self.dataloader is not None and TT_DATALOADER not in skip
                else None
            ),
            extra={"torchtitan": _States(self.states)} if self.states else None,
            rng=self.rng,
            modules={f"{PART_PREFIX}{i}": m for i, m in enumerate(self.parts) if i > 0} or None,
            optimizers=(
                {f"{PART_PREFIX}{i}": _one_or_list(o) for i, o in by_part.items() if i > 0} or None
                if with_optim
                else None
            ),
        )

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        # torchtitan's rule (dcp.py ``_should_save``): the first step if asked, the last, every ``interval``
        # steps; the manager's maybe_save owns the interval (and the save on a preemption notice).
        if self.load_only:
            return False
        if last_step or (curr_step == 1 and self.first_step):
            self._manager.save(curr_step, self._state)
        elif not self._manager.maybe_save(curr_step, self._state):
            return False
        if last_step:
            # The trainer closes right after its last step: that checkpoint is written before save returns.
            self._manager.wait()
        elif self.async_save:
            self.save_future = Future()  # resolved by maybe_wait_for_saving (safepoint's wait())
        return True

    def _load(self, step: int = -1) -> bool:
        loaded = self._manager.restore(
            self.train_state(loading=True),
            None if step == -1 else step,
            strict=not self.exclude,  # an excluded part is in the checkpoint, not in the target
        )
        return loaded > 0

    def _maybe_wait_for_staging(self) -> None:
        # Nothing to wait for: safepoint's async save copies the state to host memory before save() returns
        # (the copy the optimizer step must not race); only the write runs on in the background.
        return None

    def _wait_for_saving(self) -> None:
        self._manager.wait()
        assert self.save_future is not None  # base.py calls this only when it is set
        self.save_future.set_result(None)
        self.save_future = None

    def _close(self) -> None:
        # hasattr: __del__ can run on an object whose __init__ raised before the manager existed.
        if hasattr(self, "_manager"):
            self._manager.close()


def _optimizers_by_part(container: Any, parts: list[nn.Module]) -> dict[int, list[Any]]:
    """torchtitan's ``OptimizersContainer`` holds one optimizer per model part; each goes with the part whose
    parameters it steps (safepoint keys an optimizer's state by that module's parameter names)."""
    if container is None:
        return {}
    by_part: dict[int, list[Any]] = {}
    for opt in getattr(container, "optimizers", [container]):
        params = {id(p) for group in opt.param_groups for p in group["params"]}
        owner = next((i for i, m in enumerate(parts) if any(id(p) in params for p in m.parameters())), None)
        if owner is None:
            raise ValueError("SafepointCheckpointManager: an optimizer steps no parameter of any model part")
        by_part.setdefault(owner, []).append(opt)
    return by_part


def _one_or_list(opts: list[Any] | None) -> Any:
    if not opts:
        return None
    return opts[0] if len(opts) == 1 else opts
