"""A 2-rank torchrun training job for the SIGKILL campaign (tests/torture/test_torture_kill.py).

    python -m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=R dist_train.py PLAN.json

PLAN.json: {"out": DIR, "steps": N, "jobs": ["ref", "run"], "gate": {"job": "run", "deadline": T}}. Each
job trains the same deterministic DDP model (dropout, per-rank data from every RNG) for N steps, saving
every step under DIR/<job>/ckpt. "ref" is never killed; the parent SIGKILLs ranks of "run" at random
moments and torchrun restarts both ranks, which resume from the newest checkpoint. A job finished in an
earlier attempt (DIR/<job>.done) is skipped. Events go to DIR/log.rank<R>.jsonl; rank 0 writes
DIR/<job>.final.pt (model + optimizer).

The gate: the "gate" job logs "gate" before its last step and waits there until DIR/finish exists, which
the parent writes once it has made all its kills. However late the parent reads the logs, the run cannot
end before it is done with it; a kill that has not happened yet is made at the gate (a resume there still
trains and saves the last step). T (wall clock) is a backstop: the gate opens by itself then, so the
ranks never wait for a parent that died without writing the file.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

import safepoint
from tests.helpers.procs.exiting import run_then_exit

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
FINISH = "finish"  # the gate's file, under DIR (tests/torture/kills.py writes it)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def wait_at_gate(finish: Path, deadline: float) -> None:
    """Until the parent wrote ``finish`` (or the deadline passed). Here each rank waits by itself, with no
    collective: the file is written once and never removed, so both ranks leave the gate, a poll apart,
    and the first one out waits for the other in the next step's allreduce. (scenarios.train's children
    wait here too.)"""
    while not finish.exists() and time.time() < deadline:
        time.sleep(0.02)


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    out, steps = Path(plan["out"]), int(plan["steps"])
    safepoint.init_process_group("gloo", timeout_s=60)
    rank = dist.get_rank()
    log_path = out / f"log.rank{rank}.jsonl"

    def log(job: str, event: str, **fields: Any) -> None:
        with open(log_path, "a") as f:
            f.write(
                json.dumps({"job": job, "event": event, "attempt": ATTEMPT, "t": time.time(), **fields})
                + "\n"
            )

    gate = plan.get("gate", {})
    log("-", "start", pid=os.getpid())
    for job in plan["jobs"]:
        if (out / f"{job}.done").exists():
            continue
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(Tiny())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
        random.seed(1000 + rank)
        np.random.seed(1000 + rank)
        torch.manual_seed(1000 + rank)
        extra: dict[str, Any] = {"seen": 0}
        state = safepoint.TrainState(model=model, optimizer=opt, scheduler=sched, extra=extra)
        with safepoint.CheckpointManager(
            out / job / "ckpt",
            save_every_steps=1,
            cluster=safepoint.ClusterOptions(collective_timeout_s=30),
            keep=safepoint.Keep(last=2),
        ) as mgr:
            listed = [c.step for c in mgr.list()]
            step = mgr.restore(state)
            log(job, "restored", step=step, listed=listed, pid=os.getpid(), seen=extra["seen"])
            while step < steps:
                if job == gate.get("job") and step == steps - 1:
                    log(job, "gate", step=step)
                    wait_at_gate(out / FINISH, float(gate["deadline"]))
                x = torch.randn(4, 8) + float(np.random.rand()) + random.random()
                y = torch.randn(4, 2)
                loss = ((model(x) - y) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                extra["seen"] += len(x)
                step += 1
                log(job, "begin", step=step)
                mgr.maybe_save(step, state)
                log(job, "end", step=step)
        model_sd, opt_sd = get_state_dict(model, opt)
        log(job, "finished", step=step, seen=extra["seen"], draw=torch.rand(3).tolist())
        if rank == 0:
            torch.save({"model": model_sd, "optim": opt_sd}, out / f"{job}.final.pt")
        dist.barrier()
        if rank == 0:
            (out / f"{job}.done").touch()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_then_exit(main)  # never through the teardown: tests/helpers/procs/exiting.py
