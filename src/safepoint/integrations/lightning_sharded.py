"""The Lightning callback's sharded path: ``FSDPStrategy`` and ``ModelParallelStrategy`` (FSDP2/TP).

These strategies do not restore the weights and optimizer state from Lightning's checkpoint dict: their
``load_model_state_dict`` and ``load_optimizer_state_dict`` do nothing (``lightning_restore_optimizer`` is
False), because their own ``load_checkpoint`` loads both through DCP before. A callback that hands Lightning
a dict holding the weights would resume with the weights and moments of a fresh run. So the callback gives
the sharded module and its optimizers to safepoint's own sharded path, ``TrainState(model=strategy.model,
optimizer=strategy.optimizers)`` (``get_state_dict``/``set_state_dict``: each rank writes its shards; a
restore at another world size reshards), and Lightning's dict carries the rest (loops, callbacks,
schedulers, precision, datamodule).

DeepSpeed is refused: its engine partitions the optimizer state in its own (ZeRO) layout, saved and loaded by
``engine.save_checkpoint``/``load_checkpoint``, which DCP does not read or write.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

# The two Strategy methods dump_checkpoint asks for the weights and each optimizer's state.
_WEIGHTS_HOOKS = ("lightning_module_state_dict", "optimizer_state")


def refuse_unsupported(strategy: Any, refused: tuple[type, ...]) -> None:
    """A one-line error, before the root is touched, for a strategy whose state safepoint cannot save."""
    if isinstance(strategy, refused):
        raise ValueError(
            f"SafepointCallback: {type(strategy).__name__} is not supported: DeepSpeed's engine "
            "partitions the optimizer state in its own ZeRO layout and saves it only through "
            "engine.save_checkpoint, which safepoint's DCP path does not read or write; use FSDPStrategy "
            "or ModelParallelStrategy (saved sharded), DDP or one device (docs/frameworks/lightning.md)"
        )


def sharded_parts(trainer: Any) -> tuple[nn.Module, list[Any] | None]:
    """The strategy's (sharded) module and its optimizers, for ``TrainState(model=, optimizer=)``."""
    strategy = trainer.strategy
    if not strategy.restore_checkpoint_after_setup:
        # The restore in on_fit_start relies on Lightning restoring the rest only after it.
        raise RuntimeError(
            f"SafepointCallback: {type(strategy).__name__} restores before its setup; its sharded state "
            "cannot be restored by the callback"
        )
    model = strategy.model
    if not isinstance(model, nn.Module):
        raise RuntimeError(f"SafepointCallback: {type(strategy).__name__} holds no module to save")
    optimizers = list(strategy.optimizers)
    return model, optimizers or None


@contextmanager
def without_weights(strategy: Any) -> Iterator[None]:
    """Lightning's ``dump_checkpoint`` without the weights and optimizer state (saved sharded beside it):
    for ``FSDPStrategy(state_dict_type="full")`` they would be gathered to every rank, only to be dropped.
    The dict's ``state_dict`` and ``optimizer_states`` are then empty."""
    for name in _WEIGHTS_HOOKS:
        setattr(strategy, name, _empty)  # on the instance, undone below
    try:
        yield
    finally:
        for name in _WEIGHTS_HOOKS:
            delattr(strategy, name)


def _empty(*args: Any) -> dict[str, Any]:
    return {}
