"""SafepointCallback in process: a finished root trains nothing more, what the Trainer would get wrong after
a resume is refused with the numbers named, and the callback's inputs are checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import safepoint
from safepoint.integrations.hf_trainer import SafepointCallback


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


def test_a_finished_root_trains_nothing_more(tmp_path: Path) -> None:
    first = train(tmp_path, steps=4, save_every=3)  # 3 batches an epoch: step 4 is in epoch 1
    assert first.state.global_step == 4
    again = train(tmp_path, steps=4, save_every=3)
    assert again.state.global_step == 4  # restored, and no step past max_steps
    # The restored history, plus the end of this call (as after the Trainer's own resume): no step trained.
    assert [h["step"] for h in again.state.log_history if "train_loss" in h] == [4, 4]
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        assert [c.step for c in mgr.list()] == [3, 4]  # the periodic save and the final one


def test_accumulation_that_does_not_divide_the_epoch_is_refused_on_a_mid_epoch_resume(tmp_path: Path) -> None:
    # 20 samples / 4 = 5 batches an epoch; accumulating 2: the first save (step 1) is at batch 2 of epoch 0.
    with pytest.raises(KeyboardInterrupt):
        with safepoint.CheckpointManager(tmp_path / "ckpt", save_every_steps=1) as mgr:
            t = trainer(tmp_path, steps=6, accumulation=2, samples=20)
            SafepointCallback.attach(t, mgr)
            t.add_callback(StopAfterFirstSave())
            t.train()
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2 .* per epoch \(5\)"):
        train(tmp_path, steps=6, save_every=1, accumulation=2, samples=20)


class StopAfterFirstSave(TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        raise KeyboardInterrupt  # after SafepointCallback.on_step_end saved step 1: the job dies here


def test_attach_checks_its_inputs(tmp_path: Path) -> None:
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        with pytest.raises(ValueError, match="needs a Trainer"):
            SafepointCallback.attach(object(), mgr)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="needs a CheckpointManager"):
            SafepointCallback.attach(trainer(tmp_path, 1), object())  # type: ignore[arg-type]


class SaveRecorder(TrainerCallback):
    """Records each on_save: the step it is told of, the directory, and whether that one is committed."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, str, bool]] = []

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        directory = Path(kw["checkpoint_dir"])
        self.seen.append((state.global_step, directory.name, (directory / "safepoint.json").is_file()))


def test_callbacks_hear_of_an_async_save_only_once_it_is_committed(tmp_path: Path) -> None:
    recorder = SaveRecorder()
    with safepoint.CheckpointManager(tmp_path / "ckpt", save_every_steps=2, async_save=True) as mgr:
        t = trainer(tmp_path, steps=5)
        SafepointCallback.attach(t, mgr)
        t.add_callback(recorder)
        t.train()
        assert [c.step for c in mgr.list()] == [2, 4, 5]
    assert recorder.seen == [(s, f"step-{s}", True) for s in (2, 4, 5)]
