"""What tests/integrations/test_hf_trainer_callback.py builds on ``transformers``, apart from the tests.

Imported inside the tests, never at a test module's top: pytest-xdist's workers each import every test
module to collect it, and ``transformers`` (with ``peft``, which safepoint.integrations.hf_trainer brings)
costs ~3 s of CPU a worker (tests/test_architecture.py keeps it so)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import safepoint
from safepoint.integrations.hf_trainer import SafepointCallback

__all__ = ["SafepointCallback", "SaveRecorder", "StopAfterFirstSave", "train", "trainer"]


class Tokens(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        self.data = torch.randint(0, 32, (n, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def trainer(tmp_path: Path, steps: int, accumulation: int = 1, samples: int = 12) -> Trainer:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    args = TrainingArguments(
        output_dir=str(tmp_path / "scratch"), max_steps=steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation, save_strategy="no", report_to=[], use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    return Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens(samples))


def train(tmp_path: Path, steps: int, save_every: int, **kw: Any) -> Trainer:
    with safepoint.CheckpointManager(tmp_path / "ckpt", save_every_steps=save_every) as mgr:
        t = trainer(tmp_path, steps, **kw)
        SafepointCallback.attach(t, mgr)
        t.train()
    return t


class StopAfterFirstSave(TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        raise KeyboardInterrupt  # after SafepointCallback.on_step_end saved step 1: the job dies here


class SaveRecorder(TrainerCallback):
    """Records each on_save: the step it is told of, the directory, and whether that one is committed."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, str, bool]] = []

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        directory = Path(kw["checkpoint_dir"])
        self.seen.append((state.global_step, directory.name, (directory / "safepoint.json").is_file()))
