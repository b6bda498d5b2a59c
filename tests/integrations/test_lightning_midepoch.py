"""A mid-epoch resume with a DataLoader without worker processes, in this process: every loss after the
resume is the uninterrupted run's, bit for bit, through the rest of the epoch and into the next.

Lightning counts the batches done before the save as already fetched and ends the epoch when that count
reaches the loader's length; the callback makes the epoch's iterator again after putting the sampler's
position back, and a loader without workers then reads the length of the rest of the epoch only: the epoch
ended that many batches early (the next epoch's batches came in, and every later loss differed)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import safepoint

# lightning is imported inside _fit (tests/integrations/lightning_parts.py): every xdist worker imports this
# module to collect it, and only the one that runs it should pay for the framework.
N, BATCH = 24, 4  # 6 batches an epoch


def _fit(root: Path, steps: int) -> dict[int, float]:
    from tests.integrations.lightning_parts import L, SafepointCallback
    from tests.integrations.lightning_parts import LossRecordingNet as Net

    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g))
    loader = DataLoader(data, batch_size=BATCH, sampler=safepoint.ResumableSampler(N, seed=0))
    model = Net()
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, enable_checkpointing=False, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[SafepointCallback(str(root), save_every_steps=2)],
    )  # fmt: skip
    trainer.fit(model, loader)
    return model.losses


def test_a_mid_epoch_resume_without_workers_keeps_the_epochs_length(tmp_path: Path) -> None:
    reference = _fit(tmp_path / "reference", 9)
    assert sorted(reference) == list(range(1, 10))
    _fit(tmp_path / "ckpt", 2)  # saved at step 2: 4 batches of epoch 0 left
    resumed = _fit(tmp_path / "ckpt", 9)
    assert sorted(resumed) == list(range(3, 10))
    assert resumed == {step: reference[step] for step in range(3, 10)}
