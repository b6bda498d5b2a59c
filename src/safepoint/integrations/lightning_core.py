"""The Lightning callback's hooks, shared by ``lightning`` and ``pytorch_lightning`` (the two packages have
their own ``Callback`` classes; integrations/lightning.py and lightning_pl.py each subclass theirs with this).

Why a callback, not a ``CheckpointIO``: a CheckpointIO is called by ``trainer.save_checkpoint`` on rank 0
only (safepoint's save is collective), is given a path to write (safepoint commits ``step-N`` itself), is
never asked which checkpoint to resume (``ckpt_path="last"`` is the newest file by mtime, complete or not),
and sees neither the per-rank RNG (Lightning saves none), the data position, nor the SIGTERM. A callback is
in the loop at each of those points:

- ``setup`` (before Lightning restores anything): opens the CheckpointManager and restores the newest intact
  checkpoint into plain containers (``PlainState``: no template), which it hands to Lightning's own restore
  path, so loops and their progress, callbacks, optimizers, schedulers, precision/scaler and datamodule come
  back exactly as Lightning would restore them from a ``.ckpt``.
- Sharded strategies (``FSDPStrategy``, ``ModelParallelStrategy``): the weights and optimizer state are not
  in Lightning's dict (its ``load_model_state_dict``/``load_optimizer_state_dict`` do nothing for them: their
  ``load_checkpoint`` loads through DCP itself). They go through safepoint's sharded path instead
  (``TrainState(model=strategy.model, optimizer=...)``: each rank writes its shards, DCP reshards on load),
  restored in ``on_fit_start``, the first hook after the strategy sharded the model and built the optimizers
  and before Lightning restores the rest (``restore_checkpoint_after_setup``); see lightning_sharded.py.
- ``on_train_start``: the data position goes back into the ``ResumableSampler`` (after Lightning read
  ``len(dataloader)`` for the whole epoch; the epoch's iterator is made again from it), and safepoint's
  SIGTERM handler replaces Lightning's (installed just before: it would raise ``SIGTERMException``, a
  ``SystemExit`` with code 0, at the end of the batch, possibly after this batch's save: a preempted job
  recorded as succeeded).
- ``on_train_start`` / ``on_train_batch_start``: the per-rank RNG goes back where the interrupted run had
  it (around the DataLoader iterator's creation, which draws from the global RNG; see ``_rng_at``).
- ``on_train_batch_end``: ``maybe_save(global_step)``; on a preemption notice the emergency save of this
  step, then ``Preempted`` (exit code 143) out of ``trainer.fit``.
"""

from __future__ import annotations

import logging
import signal
import warnings
from typing import Any

import torch

from safepoint.data import rng
from safepoint.data.plain import PlainState
from safepoint.data.restorable import restorable
from safepoint.data.sampler import ResumableSampler
from safepoint.errors import Preempted
from safepoint.integrations.lightning_sharded import refuse_unsupported, sharded_parts, without_weights
from safepoint.manager import CheckpointManager
from safepoint.options import PreemptionOptions
from safepoint.state import TrainState

log = logging.getLogger("safepoint")

LIGHTNING = "lightning"  # objects.lightning: Lightning's own checkpoint dict (replicated, like the model)
RANK = "rank"  # extra.rank: this rank's RNG and data position
_RNG, _SAMPLER, _MID_EPOCH = "rng", "sampler", "mid_epoch"
_HPARAMS = ("hyper_parameters", "datamodule_hyper_parameters")


class SafepointHooks:
    """The hooks (see the module docstring); ``SafepointCallback`` in lightning.py / lightning_pl.py."""

    _sigterm_exception: type[BaseException] = SystemExit
    _sharded: tuple[type, ...] = ()  # saved through DCP (lightning_sharded.py)
    _refused: tuple[type, ...] = ()  # DeepSpeed (lightning_sharded.refuse_unsupported says why)

    def __init__(
        self, root: str, *, preemption: PreemptionOptions | None = None, **manager_options: Any
    ) -> None:
        self.root = root
        self._options = dict(manager_options)
        # A preempted Lightning job must always save and exit 143: SIGTERM is a notice unless told otherwise.
        self._preemption = preemption or PreemptionOptions(signals=(signal.SIGTERM,))
        self._signals = list(self._preemption.signals)
        self.manager: CheckpointManager | None = None
        """The CheckpointManager while ``fit`` runs (list(), latest_step(), durability_lag())."""
        self.restored_step = 0
        """The step ``fit`` resumed from (0: a fresh run)."""
        self._rank_state: dict[str, Any] | None = None  # restored, applied at the train start
        self._sampler: ResumableSampler | None = None
        self._handler: Any = None  # safepoint's SIGTERM handler, re-installed over Lightning's
        self._pending: int | None = None  # an async save not yet known committed (loggers wait for it)
        self._last_saved: int | None = None
        self._sharded_run = False  # the strategy shards: model and optimizers through DCP
        # ModelCheckpoint's attributes that loggers' after_save_checkpoint reads.
        self.dirpath, self.last_model_path, self.best_model_path = str(root), "", ""
        self.best_k_models: dict[str, Any] = {}
        self.best_model_score: Any = None
        self.monitor: str | None = None

    @property
    def state_key(self) -> str:
        return f"SafepointCallback[{self.root}]"

    # ---- setup: open the manager and restore -----------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        refuse_unsupported(trainer.strategy, self._refused)
        self._sharded_run = isinstance(trainer.strategy, self._sharded)
        self.manager = CheckpointManager(self.root, preemption=self._preemption, **self._options)
        self._handler = signal.getsignal(signal.SIGTERM) if self._signals else None
        if not self._sharded_run:  # sharded: the model is not sharded yet; restored in on_fit_start
            self._restore(trainer, model=None, optimizers=None)

    def _restore(self, trainer: Any, model: Any, optimizers: Any) -> None:
        assert self.manager is not None
        full, ranked = PlainState(), PlainState()
        state = TrainState(
            model=model, optimizer=optimizers, objects={LIGHTNING: full}, extra={RANK: ranked}, rng=False
        )
        self.restored_step = self.manager.restore(state)
        if self.restored_step:
            # Lightning's own restore runs right after the setup hooks (after on_fit_start for the sharded
            # strategies) and loads whatever is in this dict, exactly as from a .ckpt file (its
            # `_restore_modules_and_callbacks(None)` keeps it).
            connector = trainer._checkpoint_connector
            if not hasattr(connector, "_loaded_checkpoint"):
                raise RuntimeError("SafepointCallback: this Lightning version has no _loaded_checkpoint")
            connector._loaded_checkpoint = full.value
            self._rank_state = ranked.value
            self.last_model_path = str(self.manager.layout.step_path(self.restored_step))
            self._last_saved = self.restored_step

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self._sharded_run and self.manager is not None:
            self._restore(trainer, *sharded_parts(trainer))
        if self.restored_step and trainer.ckpt_path:
            raise ValueError(
                f"SafepointCallback resumed step {self.restored_step} from {self.root}, but fit(ckpt_path="
                f"{trainer.ckpt_path!r}) loaded another checkpoint over it: drop ckpt_path"
            )

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._sampler = _find_sampler(trainer.train_dataloader)
        if self._sampler is None:
            _warn_unreported(trainer.train_dataloader)
        saved = self._rank_state
        if saved is not None and saved.get(_MID_EPOCH) and self._sampler is not None and _SAMPLER in saved:
            # Lightning created the epoch's iterator in setup_data, after reading len(dataloader) for the
            # whole epoch (its progress counters need that) and before this hook: the sampler's position
            # goes in now, and the iterator is made again from it. (At an epoch boundary the next epoch
            # makes its own iterator after set_epoch: nothing to do.)
            fetcher = trainer.fit_loop._data_fetcher
            whole = fetcher.length  # the whole epoch's batches: setup_data's iterator, made before
            self._sampler.load_state_dict(saved[_SAMPLER])
            iter(fetcher)
            # Lightning counts the batches done before the save as fetched (the epoch loop's on_run_start
            # adds them) and ends the epoch when fetched reaches the length: the length stays the whole
            # epoch's. (A loader without workers reads the sampler's length before iterating it: the rest
            # of the epoch only, and the epoch would end that many batches early.)
            fetcher.length = whole
        elif saved is not None and not saved.get(_MID_EPOCH):
            # Resumed at an epoch boundary: Lightning goes on to the next epoch with the iterator made in
            # setup_data, before that epoch's set_epoch (its workers drew the old epoch's indices) and
            # calls no on_train_epoch_start. Select the epoch now, put the RNG back where the interrupted
            # run had it before it made that epoch's iterator, and make it.
            if self._sampler is not None:
                self._sampler.set_epoch(trainer.fit_loop.epoch_progress.current.processed)
            self._rng_at(mid_epoch=False)
            iter(trainer.fit_loop._data_fetcher)
            # Lightning warns that a mid-epoch resume of a plain DataLoader replays data: not with this one.
            warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before")
        if self._handler is not None and callable(self._handler):
            # Lightning installed its handler (notifier + ours) just before: ours alone from here on, so
            # a notice ends the job through maybe_save's emergency save, never through SIGTERMException.
            signal.signal(signal.SIGTERM, self._handler)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._rng_at(mid_epoch=True)

    def _rng_at(self, mid_epoch: bool) -> bool:
        """Put this rank's RNG back where the interrupted run had it, once. A DataLoader iterator draws its
        base seed from the global RNG when it is created: at an epoch's start in both runs, so a resume at
        an epoch boundary restores before it (train start); a resume mid-epoch creates one the interrupted
        run did not, so the RNG goes back after it (the first batch's start). Whether it did."""
        saved = self._rank_state
        if saved is None or _RNG not in saved or bool(saved.get(_MID_EPOCH)) != mid_epoch:
            return False
        rng.restore_rng(saved[_RNG])
        self._rank_state = None
        return True

    # ---- saving ------------------------------------------------------------------------------------------

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._sampler is not None:
            self._sampler.advance(_batch_len(batch, self._sampler))
        # The last step is saved here, where every periodic save is taken: from on_train_end Lightning's
        # loops have closed the epoch, and a longer run resumed from there would start a new one.
        self._save(trainer, trainer.global_step, force=_last_batch(trainer))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.manager is None:
            return
        if self._last_saved != trainer.global_step:  # stopped otherwise (early stopping, should_stop)
            self._save(trainer, trainer.global_step, force=True)
        self.manager.wait()
        self._committed(trainer)

    def _save(self, trainer: Any, step: int, force: bool) -> None:
        assert self.manager is not None
        state = self._state(trainer)
        if force:
            self.manager.save(step, state)
            saved = True
        else:
            saved = self.manager.maybe_save(step, state)  # Preempted out of here on a notice
        if saved:
            self._committed(trainer)  # the save before this one is committed: one save is in flight at most
            self._last_saved = step
            self._pending = step
            if not self._options.get("async_save", False):
                self._committed(trainer)

    def _committed(self, trainer: Any) -> None:
        """Loggers hear of a checkpoint once it is committed (Lightning #17915), never before."""
        if self._pending is None or self.manager is None:
            return
        self.last_model_path = str(self.manager.layout.step_path(self._pending))
        self._pending = None
        for logger in trainer.loggers:
            logger.after_save_checkpoint(self)

    def _state(self, trainer: Any) -> TrainState:
        mid_epoch = not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        ranked: dict[str, Any] = {_RNG: rng.capture_rng(), _MID_EPOCH: mid_epoch}
        if self._sampler is not None:
            ranked[_SAMPLER] = self._sampler.state_dict()
        objects = {LIGHTNING: _LightningDump(trainer, self._sharded_run)}
        model, optimizers = sharded_parts(trainer) if self._sharded_run else (None, None)
        return TrainState(
            model=model, optimizer=optimizers, objects=objects, extra={RANK: PlainState(ranked)}, rng=False
        )

    # ---- the end -----------------------------------------------------------------------------------------

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        manager, self.manager = self.manager, None
        if manager is None:
            return
        try:
            manager.close()  # the save in flight finishes; Preempted's own save is committed already
        except Exception as e:
            log.error("safepoint: while closing after %r: %s", exception, e)
        if isinstance(exception, self._sigterm_exception) and not isinstance(exception, Preempted):
            # Lightning's SIGTERMException (a signal before on_train_start replaced its handler): nothing
            # was trained since the restore, so nothing is lost; exit as preempted, never with code 0.
            code = 143
            raise Preempted(code, step=trainer.global_step, saved_step=self._last_saved,
                            resume_step=self._last_saved, reason="SIGTERM (Lightning)")  # fmt: skip

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        manager, self.manager = self.manager, None
        if manager is not None:
            manager.close()
            self._committed(trainer)


class _LightningDump(PlainState):
    """Lightning's checkpoint dict, built only when a save captures it: ``maybe_save`` decides first, and
    most steps do not save."""

    def __init__(self, trainer: Any, sharded: bool) -> None:
        super().__init__()
        self._trainer = trainer
        self._sharded = sharded  # the weights and optimizer state are saved sharded, beside this dict

    def state_dict(self) -> dict[str, Any]:
        connector = self._trainer._checkpoint_connector
        if self._sharded:
            with without_weights(self._trainer.strategy):
                ckpt = connector.dump_checkpoint(weights_only=False)
        else:
            ckpt = connector.dump_checkpoint(weights_only=False)
        for key in _HPARAMS:  # for load_from_checkpoint, not for resuming: dropped if not plain data
            if key in ckpt and not _plain(ckpt[key]):
                log.warning("safepoint: %s is not plain data; not saved (resuming does not need it)", key)
                del ckpt[key]
        self.value = ckpt
        return super().state_dict()


def _last_batch(trainer: Any) -> bool:
    """This batch ends the fit: ``max_steps`` reached, or the last batch of the last epoch."""
    if 0 <= trainer.max_steps <= trainer.global_step:
        return True
    epochs = trainer.max_epochs
    last_epoch = epochs is not None and 0 <= epochs <= trainer.current_epoch + 1
    return bool(last_epoch and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def _plain(value: Any) -> bool:
    try:
        restorable(PlainState(dict(value)).state_dict())
    except Exception:
        return False
    return True


def _find_sampler(loader: Any) -> ResumableSampler | None:
    for candidate in (
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    ):
        if isinstance(candidate, ResumableSampler):
            return candidate
    return None


def _warn_unreported(loader: Any) -> None:
    """A train DataLoader whose position nothing reports: a resume mid-epoch replays the epoch's start."""
    if loader is None or hasattr(loader, "state_dict"):
        return  # a stateful loader (torchdata's StatefulDataLoader): Lightning saves its position itself
    sampler = getattr(loader, "sampler", None)
    warnings.warn(
        f"SafepointCallback: the train DataLoader's sampler ({type(sampler).__name__}, num_workers="
        f"{getattr(loader, 'num_workers', 0)}) does not report its position: a resume mid-epoch cannot "
        "continue with the next unseen batch. Use DataLoader(sampler=safepoint.ResumableSampler(n, "
        "...)) (the callback reports each batch to it), or a StatefulDataLoader",
        stacklevel=2,
    )


def _batch_len(batch: Any, sampler: ResumableSampler) -> int:
    """Samples in ``batch`` (the first tensor's length, looking inside tuples, lists and dicts)."""
    todo = [batch]
    while todo:
        item = todo.pop(0)
        if isinstance(item, torch.Tensor) and item.dim() > 0:
            return int(item.shape[0])
        if isinstance(item, (list, tuple)):
            todo.extend(item)
        elif isinstance(item, dict):
            todo.extend(item.values())
    raise ValueError(
        f"SafepointCallback: cannot tell how many samples a {type(batch).__name__} batch holds (no tensor in "
        "it): the ResumableSampler's position needs it"
    )
