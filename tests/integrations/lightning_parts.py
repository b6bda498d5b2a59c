"""What tests/integrations/test_lightning_callback.py and test_lightning_midepoch.py build on ``lightning``,
apart from the tests.

Imported inside the tests, never at a test module's top: pytest-xdist's workers each import every test
module to collect it, and ``lightning`` (with torchmetrics and matplotlib behind it) costs ~3 s of CPU a
worker; only the worker that runs these tests should pay for it (tests/test_architecture.py keeps it so)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch import nn

from safepoint.integrations.lightning import SafepointCallback

__all__ = [
    "DeepSpeedStrategy", "L", "LossRecordingNet", "Net", "Recorder", "SafepointCallback", "SigtermAt",
    "net_class", "trainer",
]  # fmt: skip


def net_class(base: Any) -> Any:
    """The same tiny module on ``lightning``'s or ``pytorch_lightning``'s LightningModule."""

    class Net(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Net


Net = net_class(L.LightningModule)


def trainer(callbacks: list[Any], steps: int = 6, **kw: Any) -> L.Trainer:
    options: dict[str, Any] = dict(
        max_steps=steps, accelerator="cpu", devices=1, enable_checkpointing=False, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    return L.Trainer(callbacks=callbacks, **(options | kw))


class SigtermAt(L.Callback):
    """Sends SIGTERM to this process in ``hook`` at ``step`` (after the callbacks before it ran)."""

    def __init__(self, hook: str, step: int = 0) -> None:
        self.hook, self.step = hook, step
        setattr(self, hook, self._fire)

    def _fire(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class Recorder(Logger):
    """Records, at each after_save_checkpoint, the checkpoint it is told of and whether it is committed."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, bool]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, *args: Any, **kwargs: Any) -> None:
        pass

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        path = Path(checkpoint_callback.last_model_path)
        self.seen.append((path.name, (path / "safepoint.json").is_file()))


class LossRecordingNet(L.LightningModule):
    """test_lightning_midepoch.py's module: records each optimizer step's loss, keyed by the step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
        self.losses: dict[int, float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step + 1] = loss.item()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)
