"""The Transformers Trainer + safepoint: a tiny GPT-2 (optionally LoRA through PEFT) that resumes exactly.

    python examples/hf_trainer_train.py --root ckpt --steps 40 --save-every 5 [--lora]

Prints ``step <n> loss <value>`` after every optimizer step. Stop it any way (kill -9, SIGTERM to the
process group) and run the same command again: ``trainer.train()`` continues from the newest intact
checkpoint with the losses an uninterrupted run prints, bit for bit. SIGTERM saves the current step first
and exits with 143. The lines safepoint adds are marked ``# safepoint``; see docs/frameworks/hf_trainer.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed

import safepoint
from safepoint.integrations.hf_trainer import SafepointCallback

VOCAB, SEQ = 64, 16


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """Fixed random sequences, each with a random 10% of tokens replaced in the worker (an augmentation
    drawn from the worker's seed: a resume that changed worker seeds would change every loss)."""

    def __init__(self, n: int) -> None:
        self.data = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        seq = self.data[i].clone()
        noise = torch.rand(SEQ) < 0.1
        seq[noise] = torch.randint(0, VOCAB, (int(noise.sum()),))
        return {"input_ids": seq, "labels": seq}


class PrintLoss(TrainerCallback):  # type: ignore[misc]
    """Prints each optimizer step's training loss at full precision (the Trainer's log rounds it)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.loss: torch.Tensor | None = None
        model.register_forward_hook(self._record)

    def _record(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if module.training:
            self.loss = output.loss.detach()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.loss is not None
        print(f"step {state.global_step} loss {self.loss.item()!r}", flush=True)
        if STEP_SLEEP:
            time.sleep(STEP_SLEEP)


STEP_SLEEP = 0.0


def main() -> int:
    global STEP_SLEEP
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True, help="checkpoint directory")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (PEFT) on a frozen base")
    args = p.parse_args()
    STEP_SLEEP = args.step_sleep

    set_seed(0)
    config = GPT2Config(  # dropout 0.1 (GPT-2's default)
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model: torch.nn.Module = GPT2LMHeadModel(config)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["c_attn"], fan_in_fan_out=True)
        model = get_peft_model(model, lora)
    scratch = tempfile.mkdtemp(prefix="hf-trainer-")
    training = TrainingArguments(
        output_dir=scratch,  # save_strategy="no": the Trainer writes nothing here
        max_steps=args.steps,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        lr_scheduler_type="linear",
        dataloader_num_workers=2,
        save_strategy="no",  # safepoint saves
        logging_steps=5,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    with safepoint.CheckpointManager(  # safepoint
        args.root,
        save_every_steps=args.save_every,
        keep=safepoint.Keep(last=3),
        async_save=True,
        preemption=safepoint.PreemptionOptions(signals=(signal.SIGTERM,)),
    ) as mgr:
        trainer = Trainer(
            model=model, args=training, train_dataset=Tokens(96), callbacks=[PrintLoss(model)]
        )  # 12 batches an epoch
        SafepointCallback.attach(trainer, mgr)  # safepoint: restore in train(), save every step it is due
        trainer.train()
    os.rmdir(scratch)
    return 0


if __name__ == "__main__":
    code = 1
    try:
        code = main()
    except safepoint.Preempted as e:  # saved: 143 tells the orchestrator to start the job again
        code = e.code
    sys.stdout.flush()
    os._exit(code)  # without the interpreter's teardown, as every example ends
