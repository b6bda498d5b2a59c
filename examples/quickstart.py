"""The plain example: one process, no torchrun. The README quickstart as a program.

    python examples/quickstart.py ckpt

Run it, kill -9 it at any time, run it again: it continues from the last committed checkpoint.
"""

from __future__ import annotations

import sys

import torch

import safepoint


def main(root: str = "ckpt", total_steps: int = 200) -> int:
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    extra = {"tokens_seen": 0}

    state = safepoint.TrainState(model=model, optimizer=opt, scheduler=sched, extra=extra)
    with safepoint.CheckpointManager(root, save_every_steps=50, keep=safepoint.Keep(last=3)) as mgr:
        step = mgr.restore(state)
        while step < total_steps:
            loss = model(torch.randn(8, 16)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            extra["tokens_seen"] += 8
            step += 1
            mgr.maybe_save(step, state, metrics={"loss": loss.detach()})
    print(f"finished at step {step}, tokens_seen={extra['tokens_seen']}")
    return step


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "ckpt")
