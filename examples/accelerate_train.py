"""Hugging Face Accelerate + safepoint: a tiny causal transformer that resumes at the exact batch.

    python examples/accelerate_train.py --root ckpt --steps 40 --save-every 5

Prints ``step <n> loss <value>`` after every optimizer step. Stop it any way (kill -9, SIGTERM to the
process group) and run the same command again: it continues from the newest intact checkpoint with the
losses an uninterrupted run prints, bit for bit. SIGTERM saves the current step first and exits with 143.
The lines safepoint adds are marked ``# safepoint``; docs/frameworks/accelerate.md explains them.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, Dataset

import safepoint
from safepoint.integrations.accelerate import ReplayLoader, accelerate_state

VOCAB, SEQ, WIDTH = 64, 16, 32


class Tokens(Dataset[torch.Tensor]):
    """Fixed random sequences, each with a random 10% of tokens replaced in the worker (an augmentation
    drawn from the worker's seed: a resume that changed worker seeds would change every loss)."""

    def __init__(self, n: int) -> None:
        self.data = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        seq = self.data[i].clone()
        noise = torch.rand(SEQ + 1) < 0.1
        seq[noise] = torch.randint(0, VOCAB, (int(noise.sum()),))
        return seq


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, nhead=2, dim_feedforward=64, dropout=0.1, batch_first=True)
        self.body = nn.TransformerEncoder(layer, num_layers=2)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        out: torch.Tensor = self.head(self.body(self.embed(x), mask=mask, is_causal=True))
        return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True, help="checkpoint directory")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()

    accelerator = Accelerator(cpu=True)
    set_seed(0)
    model = TinyLM()  # dropout on: the torch RNG is part of the state
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=args.steps)
    data = DataLoader(Tokens(96), batch_size=8, shuffle=True, num_workers=2)  # 12 batches an epoch
    model, opt, data, sched = accelerator.prepare(model, opt, data, sched)
    loader = ReplayLoader(data)  # safepoint: continues the epoch at the exact batch
    state = accelerate_state(accelerator, loader)  # safepoint: what save_state would save, and RNG

    with safepoint.CheckpointManager(  # safepoint
        args.root,
        save_every_steps=args.save_every,
        keep=safepoint.Keep(last=3),
        async_save=True,
        preemption=safepoint.PreemptionOptions(signals=(signal.SIGTERM,)),
    ) as mgr:
        step = saved_at = mgr.restore(state)  # safepoint: 0 on a fresh root
        model.train()
        while step < args.steps:
            for batch in loader:  # after a restore: the rest of the saved epoch first
                logits = model(batch[:, :-1])
                loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
                accelerator.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
                step += 1
                print(f"step {step} loss {loss.item()!r}", flush=True)
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                # safepoint: saves every --save-every steps; on SIGTERM saves this step, raises Preempted
                if mgr.maybe_save(step, state, metrics={"loss": loss.detach()}):
                    saved_at = step
                if step == args.steps:
                    break
        if saved_at != step:
            mgr.save(step, state)  # the final state, so a rerun has nothing left to do
    return 0


if __name__ == "__main__":
    code = 1
    try:
        code = main()
    except safepoint.Preempted as e:  # saved: 143 tells the orchestrator to start the job again
        code = e.code
    sys.stdout.flush()
    # Without the interpreter's teardown (as every example does; DataLoader workers are shielded children).
    os._exit(code)
