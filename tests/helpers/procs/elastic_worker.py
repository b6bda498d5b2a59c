"""A torchrun worker for tests/dist/test_elastic.py: an elastic job that trains until torchrun's agent stops it.

    torchrun --nnodes=1:2 --rdzv-backend=c10d ... elastic_worker.py OUT ROOT FINAL_STEPS

At world size 1 it trains (slowly, one step per ~10 ms) until a notice arrives; after 3 steps it writes
OUT/ready, so the test knows when to add the second node. The agent's SIGTERM (scale-up) is a preemption
notice: the emergency save commits the current step and ``Preempted`` ends the worker. At world size 2 it
restores, trains FINAL_STEPS more steps and ends. Every step, restore and notice is a JSON line in
OUT/log.jsonl (appended by every rank of every generation; one line per write, O_APPEND).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import safepoint
from tests.helpers.procs.exiting import run_then_exit


def main() -> None:
    out, root, final_steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    safepoint.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def log(event: str, **fields: object) -> None:
        record = {"event": event, "rank": rank, "world": world, "host": socket.gethostname(), **fields}
        with open(out / "log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = safepoint.TrainState(model=model, optimizer=opt)
    mgr = safepoint.CheckpointManager(
        root, save_every_steps=10_000, preemption=safepoint.PreemptionOptions(signals=[signal.SIGTERM])
    )
    try:
        with mgr:
            step = mgr.restore(state)
            log("restored", step=step)
            end = step + final_steps if world > 1 else 1_000_000
            while step < end:
                g = torch.Generator().manual_seed(step)
                loss = model(torch.randn(4, 8, generator=g)).square().mean()
                opt.zero_grad()
                loss.backward()
                for p in model.parameters():  # the same update on every rank (no DDP wrapper needed)
                    dist.all_reduce(p.grad)
                opt.step()
                step += 1
                log("step", step=step)
                if world == 1 and step == 3:
                    (out / "ready").write_text(str(os.getpid()))
                if world == 1:
                    time.sleep(0.01)  # leave the CPU to the agents (not needed for correctness)
                mgr.maybe_save(step, state)
    except safepoint.Preempted as e:
        log("preempted", step=e.step, saved_step=e.saved_step)
        raise
    log("finished", step=step)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_then_exit(main)  # never through the teardown: tests/helpers/procs/exiting.py
