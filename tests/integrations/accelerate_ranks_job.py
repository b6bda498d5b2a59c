"""A job for tests/integrations/test_accelerate_ranks.py, started by ``accelerate launch --cpu
--num_processes 2``: a tiny model with dropout, a shuffled DataLoader that Accelerate shards between the
processes, safepoint's ``accelerate_state`` + ``ReplayLoader``, a sync save every ``--save-every`` steps.

Each process prints ``rank R step N loss V`` per optimizer step and writes its pid to ``<root>.pid-R``
(torchrun, under ``accelerate launch``, starts each worker in a session of its own: a test that kills the
whole job needs the workers' pids).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import safepoint
from safepoint.integrations.accelerate import ReplayLoader, accelerate_state


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    Path(f"{args.root}.pid-{rank}").write_text(str(os.getpid()))
    set_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g))
    loader = DataLoader(data, batch_size=2, shuffle=True)  # 6 batches per process and epoch
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    replay = ReplayLoader(loader)
    state = accelerate_state(accelerator, replay)

    with safepoint.CheckpointManager(args.root, save_every_steps=args.save_every) as mgr:
        step = mgr.restore(state)
        while step < args.steps:
            for x, y in replay:
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
                step += 1
                # One write per line: both processes share the pipe; a short write is never split.
                sys.stdout.write(f"rank {rank} step {step} loss {loss.item()!r}\n")
                sys.stdout.flush()
                time.sleep(args.step_sleep)
                mgr.maybe_save(step, state)
                if step == args.steps:
                    break
    accelerator.end_training()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # without the interpreter's teardown, in which gloo's threads can abort (docs/elastic.md)
