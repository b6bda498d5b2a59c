"""The Transformers Trainer: ``trainer.train()`` resumes from the newest intact safepoint checkpoint.

    with safepoint.CheckpointManager(root, save_every_steps=100, ...) as mgr:
        trainer = Trainer(model, args, train_dataset=ds)   # args.save_strategy="no": safepoint saves
        SafepointCallback.attach(trainer, mgr)
        trainer.train()

Why a callback plus one attached piece: the callback events carry everything the Trainer creates inside
``train()`` (the prepared model, optimizer, scheduler) and fire at the two moments that matter:
``on_train_begin``, after they exist and before the first batch (restore), and ``on_step_end``, right after
each optimizer step (save; on a preemption notice: save and raise ``safepoint.Preempted`` out of
``train()``). What no callback can reach is the data: the Trainer builds its DataLoader with no
``generator=``, seeds its workers from the torch RNG at the start of each epoch, and after its own resume
skips batches with another batch sampler, so the workers' seeds shift. ``attach`` therefore wraps the
Trainer's ``get_train_dataloader`` (on this instance only) in a :class:`~safepoint.data.replay.ReplayLoader`,
which replays the interrupted epoch as it first ran. The Trainer's epoch loop restarts at 0 after a restore;
the loader and this callback keep the true epoch and position, and ``state.epoch`` is corrected each step.

Restored besides the weights, optimizer, scheduler, scaler and every rank's RNG: the ``TrainerState``
progress (``global_step``, ``epoch``, ``log_history``, best metric, tokens seen, stateful callbacks) and
the Trainer's running loss bookkeeping (``_tr_loss``, ``_globalstep_last_logged``), so logged losses after a
resume are the ones an uninterrupted run logs.

The Trainer's other callbacks hear of a checkpoint through ``on_save`` only once it is committed (an async
save is written on a thread; a logger that uploads it earlier would upload half a checkpoint, Lightning
#17915): a ``when_committed`` sink queues each committed step, and the next ``on_step_end`` (or the end of
training, after the manager waited) calls ``on_save`` on the training thread with ``state.global_step`` set
to the committed step and ``checkpoint_dir=`` its committed directory (on rank 0, where commits are known).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import json
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from safepoint.data.replay import ReplayLoader
from safepoint.events import when_committed
from safepoint.manager import CheckpointManager
from safepoint.state import TrainState

__all__ = ["SafepointCallback"]

log = logging.getLogger(__name__)

TRAINER = "trainer"
SCALER = "scaler"
# TrainerState fields that describe this run's configuration, kept from the current arguments; every
# other field is progress and comes from the checkpoint.
_CONFIG_FIELDS = frozenset(
    {
        "max_steps",
        "logging_steps",
        "eval_steps",
        "save_steps",
        "train_batch_size",
        "num_train_epochs",
        "is_local_process_zero",
        "is_world_process_zero",
        "is_hyper_param_search",
    }
)


class _TrainerLoader(ReplayLoader):
    """The Trainer's loader: yields nothing once the restored run is already complete (the Trainer then
    ends at once instead of training one step past ``max_steps``)."""

    finished_run = False

    def __iter__(self) -> Iterator[Any]:
        if self.finished_run:
            return iter(())
        return super().__iter__()


class _Progress:
    """The Trainer's own progress, as one replicated named object of the checkpoint."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.control: TrainerControl | None = None  # of the step being saved (on_step_end's)

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        tr_loss = float(t._tr_loss.detach().float().sum()) if hasattr(t, "_tr_loss") else 0.0
        last_logged = int(getattr(t, "_globalstep_last_logged", 0))
        total = float(getattr(t, "_total_loss_scalar", 0.0))
        step = t.state.global_step
        if self.control is not None and self.control.should_log and step > last_logged:
            # The save runs in on_step_end, just before the Trainer logs this step: store what logging
            # leaves behind (the loss moved into the total), as a resumed run must start from it.
            gathered = t._nested_gather(t._tr_loss).mean().item() if hasattr(t, "_nested_gather") else tr_loss
            tr_loss, last_logged, total = 0.0, step, total + gathered
        progress = dataclasses.asdict(t.state)
        progress["stateful_callbacks"] = _callback_states(t)
        return {
            "trainer_state": json.dumps(progress, sort_keys=True),
            "tr_loss": tr_loss,
            "globalstep_last_logged": last_logged,
            "total_loss_scalar": total,
            "current_flos": float(getattr(t, "current_flos", 0.0)),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        t = self.trainer
        saved = json.loads(state_dict["trainer_state"])
        for field in dataclasses.fields(TrainerState):
            if field.name in saved and field.name not in _CONFIG_FIELDS:
                setattr(t.state, field.name, saved[field.name])
        t._tr_loss = torch.tensor(float(state_dict["tr_loss"]), device=t.args.device)
        t._globalstep_last_logged = int(state_dict["globalstep_last_logged"])
        t._total_loss_scalar = float(state_dict["total_loss_scalar"])
        t.current_flos = float(state_dict["current_flos"])
        # The final train_loss divides the run's loss total by the steps since _initial_global_step: with
        # the total restored, counting from 0 reports the uninterrupted run's average.
        t._initial_global_step = 0
        t._initial_num_input_tokens_seen = t.state.num_input_tokens_seen
        if t.state.stateful_callbacks and hasattr(t, "_load_callback_state"):
            t._load_callback_state()


def _callback_states(trainer: Trainer) -> dict[str, Any]:
    """The ``ExportableState`` callbacks' states, keyed as the Trainer keys them (not TrainerControl: at a
    save in ``on_step_end`` it holds this step's transient flags)."""
    out: dict[str, Any] = {}
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, ExportableState):
            name = type(cb).__name__
            if name in out:
                out[name] = [*(out[name] if isinstance(out[name], list) else [out[name]]), cb.state()]
            else:
                out[name] = cb.state()
    return out


class SafepointCallback(TrainerCallback):  # type: ignore[misc]  # transformers is not followed (pyproject.toml)
    """Restores in ``on_train_begin``, saves in ``on_step_end`` through ``manager``; see the module doc.

    Build it with :meth:`attach`. ``manager`` is the caller's open :class:`~safepoint.CheckpointManager`
    (its root, schedule, retention, async and preemption options); the final step is saved when
    training ends, and the manager waits for it.
    """

    def __init__(self, manager: CheckpointManager, trainer: Trainer) -> None:
        if not isinstance(manager, CheckpointManager):
            raise ValueError(f"SafepointCallback needs a CheckpointManager, got {type(manager).__name__}")
        self.manager = manager
        self.trainer = trainer
        self.loader: _TrainerLoader | None = None
        self.state: TrainState | None = None
        self.restored_step = 0
        self._saved_at = 0
        self._progress = _Progress(trainer)
        # (step, directory) committed on the writer thread, told to the other callbacks on the training thread
        self._committed: collections.deque[tuple[int, str]] = collections.deque()
        self._sink = when_committed(lambda step, directory: self._committed.append((step, directory)))

    @classmethod
    def attach(cls, trainer: Trainer, manager: CheckpointManager) -> SafepointCallback:
        """Add the callback to ``trainer`` and route its training DataLoader through a ReplayLoader."""
        if not isinstance(trainer, Trainer):
            raise ValueError(f"SafepointCallback.attach needs a Trainer, got {type(trainer).__name__}")
        callback = cls(manager, trainer)
        build = trainer.get_train_dataloader

        def get_train_dataloader() -> _TrainerLoader:
            callback.loader = _TrainerLoader(build())
            return callback.loader

        trainer.get_train_dataloader = get_train_dataloader
        trainer.add_callback(callback)
        manager.events.subscribe(callback._sink)
        if trainer.args.save_strategy != "no":
            log.warning(
                "safepoint: TrainingArguments(save_strategy=%r) also writes the Trainer's own checkpoints; "
                "set save_strategy='no' to save through safepoint only",
                str(trainer.args.save_strategy),
            )
        return callback

    # ---- the Trainer's events ----------------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.loader is None:
            raise RuntimeError("SafepointCallback: the Trainer did not build its DataLoader through attach()")
        self.state = self._train_state()
        step = self.manager.restore(self.state)
        self.restored_step = self._saved_at = step
        if step and state.global_step != step:
            raise RuntimeError(f"safepoint: restored step {step}; its TrainerState says {state.global_step}")
        if step and state.global_step >= state.max_steps:
            self.loader.finished_run = True  # nothing left to train: the Trainer stops at its first batch
        elif step and self.loader.batches and len(self.loader) % args.gradient_accumulation_steps:
            raise ValueError(
                "safepoint: resuming mid-epoch with gradient_accumulation_steps="
                f"{args.gradient_accumulation_steps} needs it to divide the batches per epoch "
                f"({len(self.loader)}): the Trainer's epoch restarts at 0 and would not step the last "
                "accumulation of the resumed epoch"
            )

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        assert self.state is not None and self.loader is not None
        # The Trainer computes epoch from its own count, which restarts at 0 after a restore.
        state.epoch = self.loader.epoch + self.loader.batches / max(len(self.loader), 1)
        self._progress.control = control
        try:
            if self.manager.maybe_save(state.global_step, self.state):
                self._saved_at = state.global_step
        finally:
            self._progress.control = None
        self._tell_saved(args, state, control)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.state is not None and state.global_step > self._saved_at:
            self.manager.save(state.global_step, self.state)  # so a rerun has nothing left to do
            self._saved_at = state.global_step
        self.manager.wait()
        self._tell_saved(args, state, control)
        self.manager.events.unsubscribe(self._sink)

    def _tell_saved(self, args: TrainingArguments, state: TrainerState, control: TrainerControl) -> None:
        """``on_save`` to the Trainer's callbacks for each checkpoint committed since the last call."""
        while self._committed:
            step, directory = self._committed.popleft()
            seen = copy.copy(state)  # the committed step's number, not the step the loop is at now
            seen.global_step = step
            handler = self.trainer.callback_handler
            handler.call_event("on_save", args, seen, control, checkpoint_dir=directory)

    # ---- what is saved -----------------------------------------------------------------------------------

    def _train_state(self) -> TrainState:
        t = self.trainer
        model = t.model_wrapped if isinstance(t.model_wrapped, nn.Module) else t.model
        optimizer = getattr(t.optimizer, "optimizer", t.optimizer)  # AcceleratedOptimizer wraps it
        objects: dict[str, Any] = {TRAINER: self._progress}
        scaler = getattr(t.accelerator, "scaler", None)
        if scaler is not None:
            objects[SCALER] = scaler
        return TrainState(
            model=model,
            optimizer=optimizer if isinstance(optimizer, torch.optim.Optimizer) else None,
            scheduler=t.lr_scheduler,
            dataloader=self.loader,
            objects=objects,
        )
