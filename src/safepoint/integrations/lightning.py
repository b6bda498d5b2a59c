"""safepoint for Lightning (the ``lightning`` package): one callback.

.. code-block:: python

    from safepoint.integrations.lightning import SafepointCallback

    trainer = L.Trainer(max_steps=10_000, callbacks=[SafepointCallback("ckpt/run1", save_every_steps=500)])
    trainer.fit(model, datamodule)  # resumes from the newest intact checkpoint in ckpt/run1, if any

Keyword arguments go to ``safepoint.CheckpointManager`` (``async_save``, retention, ``local_root``,
``storage_options``, ...); ``preemption`` defaults to ``PreemptionOptions(signals=(signal.SIGTERM,))``. See
docs/frameworks/lightning.md; the hooks are in lightning_core.py (shared with lightning_pl.py).
"""

from __future__ import annotations

from lightning.pytorch import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException

from safepoint.integrations.lightning_core import SafepointHooks

__all__ = ["SafepointCallback"]


class SafepointCallback(SafepointHooks, Callback):
    """Atomic, verified, async saves of the whole Lightning state; resumes from the newest intact one; a
    SIGTERM always ends in an emergency save and exit code 143 (docs/frameworks/lightning.md)."""

    _sigterm_exception = SIGTERMException
    _sharded = (FSDPStrategy, ModelParallelStrategy)
    _refused = (DeepSpeedStrategy,)
