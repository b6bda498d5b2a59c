"""A Lightning job that resumes bit for bit: a tiny causal transformer (built from code, no download) on a
synthetic token set, on the CPU, DataLoader with 2 worker processes, dropout on, several epochs.

    python examples/lightning_train.py --root ckpt --steps 30 --save-every 5 [--step-sleep 0.1]

Prints ``step <n> loss <value>`` for each optimizer step and exits 0 at step N. Stop it however you like
(kill -9, SIGTERM to the whole process group) and start it again on the same root: it continues from the
newest intact checkpoint, with the same losses an uninterrupted run prints. A SIGTERM saves the current
step first and exits with code 143. The safepoint part is the SafepointCallback line and the sampler.
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import safepoint
from safepoint.integrations.lightning import SafepointCallback

VOCAB, SEQ, SAMPLES, BATCH = 64, 16, 96, 8  # 12 batches an epoch


class Tokens(Dataset[torch.Tensor]):
    """Fixed random sequences; the next-token target of each is the sequence shifted by one."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.data = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class TinyLM(L.LightningModule):
    def __init__(self, step_sleep: float = 0.0) -> None:
        super().__init__()
        self.step_sleep = step_sleep
        self.embed = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.2, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x, y = batch[:, :-1], batch[:, 1:]
        logits = self.head(self.body(self.embed(x), mask=self.mask, is_causal=True))
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        print(f"step {self.global_step + 1} loss {loss.item()!r}", flush=True)
        if self.step_sleep:
            time.sleep(self.step_sleep)
        return loss

    def configure_optimizers(self) -> dict[str, object]:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True, help="checkpoint root (a directory or an object-store URL)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()

    L.seed_everything(0, verbose=False)
    dataset = Tokens()
    sampler = safepoint.ResumableSampler(len(dataset), seed=0)  # its position is saved with each step
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=2)
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        callbacks=[SafepointCallback(args.root, save_every_steps=args.save_every, async_save=True)],
        enable_checkpointing=False,  # safepoint saves; Lightning's own .ckpt files are not needed
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyLM(args.step_sleep), loader)


if __name__ == "__main__":
    main()
