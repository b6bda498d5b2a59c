"""safepoint for Lightning (the ``pytorch_lightning`` package): one callback.

.. code-block:: python

    from safepoint.integrations.lightning_pl import SafepointCallback

    trainer = pl.Trainer(max_steps=10_000, callbacks=[SafepointCallback("ckpt/run1", save_every_steps=500)])
    trainer.fit(model, datamodule)  # resumes from the newest intact checkpoint in ckpt/run1, if any

Keyword arguments go to ``safepoint.CheckpointManager`` (``async_save``, retention, ``local_root``,
``storage_options``, ...); ``preemption`` defaults to ``PreemptionOptions(signals=(signal.SIGTERM,))``. See
docs/frameworks/lightning.md; the hooks are in lightning_core.py (shared with lightning.py).
"""

from __future__ import annotations

from pytorch_lightning import Callback
from pytorch_lightning.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from pytorch_lightning.utilities.exceptions import SIGTERMException

from safepoint.integrations.lightning_core import SafepointHooks

__all__ = ["SafepointCallback"]


class SafepointCallback(SafepointHooks, Callback):
    """Atomic, verified, async saves of the whole Lightning state; resumes from the newest intact one; a
    SIGTERM always ends in an emergency save and exit code 143 (docs/frameworks/lightning.md)."""

    _sigterm_exception = SIGTERMException
    _sharded = (FSDPStrategy, ModelParallelStrategy)
    _refused = (DeepSpeedStrategy,)
