"""A torchrun worker for tests/preempt/test_preemption.py: small DDP jobs that get preempted or SIGKILLed.

    python -m torch.distributed.run --standalone --nproc-per-node=N [--max-restarts=R] worker.py PLAN.json

PLAN.json: {"out": DIR, "jobs": [JOB, ...]}, run by tests.helpers.torchrun.run_plan: jobs in order, one finished
in an earlier attempt (``DIR/<name>.done``) skipped, so a torchrun restart resumes the interrupted job. A JOB:

    name, root, steps        the run: DDP model with dropout, data drawn from every RNG
    save_every               periodic saves every N steps (null: none; only the emergency save)
    preempt                  install SIGTERM/SIGUSR1 handlers (PreemptionOptions.signals)
    ready_after              after this many steps past the restored one, wait for the saves so far
                             (uploads included), write DIR/<name>.ready.rank<R> (this rank's pid) and go
                             on training slowly (step_sleep_s) until signalled
    kills                    [{attempt, rank, step}]: that rank SIGKILLs itself after that step
                             (before maybe_save), in that torchrun attempt only
    vanish                   {attempt, step}: in that attempt rank 0 sends itself SIGUSR1 after that step,
                             and rank 1 SIGKILLs itself when it reads a manifest to plan the emergency
                             save (found with a CPython audit hook): a peer gone inside a collective
    save_at                  explicit saves (mgr.save) after these steps, besides any periodic ones
    local_root,              tiering: ``root`` is the durable URL, these the fast tier and s3fs options;
      storage_options        safepoint's warnings go to DIR/<name>.rank<R>.log
    grace_seconds            PreemptionOptions.grace_seconds
    dump_restored            rank 0 writes its state right after the restore to DIR/<name>.restored.pt

Signals come from the test, for real. Everything the test checks is written under DIR: JSON lines per rank
(``log.rank<R>.jsonl``), the final full state (``<name>.final.pt``, rank 0) and, when preempted, rank 0's
state at the emergency save (``<name>.preempted.pt``, the same form as ``<name>.restored.pt``).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

import safepoint
from tests.helpers.torchrun import ATTEMPT, Log, run_plan, seed_all

_VANISH: dict[str, str] = {}  # {"root": ...} once armed


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _VANISH and isinstance(args[0], str):
        path = args[0]
        if path.startswith(_VANISH["root"]) and path.endswith("safepoint.json"):
            os.kill(os.getpid(), signal.SIGKILL)


def _log_to_file(path: Path) -> None:
    """safepoint's warnings of this rank into a file of its own: the test checks each rank's plan."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logging.getLogger("safepoint").addHandler(handler)


def _local_state(model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> dict[str, Any]:
    """This rank's training state as it stands (no collective: DDP replicas are equal)."""
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return {
        "model": module.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "rng": torch.get_rng_state(),
    }


def train_job(job: dict[str, Any], out: Path, log: Log) -> None:
    name, rank = job["name"], dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    seed_all(1000 + rank)  # every rank its own dropout and data stream
    state = safepoint.TrainState(model=model, optimizer=opt, scheduler=sched, extra={"seen": 0})
    signals = (signal.SIGTERM, signal.SIGUSR1) if job.get("preempt") else ()
    tiering: dict[str, Any] = {}
    if "local_root" in job:
        tiering = {"local_root": job["local_root"], "storage_options": job["storage_options"]}
        _log_to_file(out / f"{name}.rank{rank}.log")
    with safepoint.CheckpointManager(
        job["root"],
        save_every_steps=job.get("save_every"),
        cluster=safepoint.ClusterOptions(collective_timeout_s=30),
        **tiering,
        preemption=safepoint.PreemptionOptions(signals=signals, grace_seconds=job.get("grace_seconds")),
    ) as mgr:
        step = mgr.restore(state)
        log(name, "restored", step=step, committed=[c.step for c in mgr.list()])
        if job.get("dump_restored") and rank == 0:
            torch.save(_local_state(model, opt, sched), out / f"{name}.restored.pt")
        start = step
        vanish = job.get("vanish") or {}
        vanishing = vanish.get("attempt") == ATTEMPT
        noticed = 0.0
        while step < job["steps"]:
            x = torch.randn(4, 8) + float(np.random.rand()) + random.random()
            y = torch.randn(4, 2)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            for kill in job.get("kills", []):
                if (kill["attempt"], kill["rank"], kill["step"]) == (ATTEMPT, rank, step):
                    log(name, "killing", step=step)
                    os.kill(os.getpid(), signal.SIGKILL)
            if vanishing and step == vanish.get("step"):
                if rank == 0:
                    os.kill(os.getpid(), signal.SIGUSR1)
                    noticed = time.monotonic()
                else:
                    _VANISH["root"] = job["root"]
            if vanishing:
                time.sleep(0.05)  # steps slow enough that the ranks compare flags every few steps
            if "ready_after" in job and step - start >= job["ready_after"]:
                ready = out / f"{name}.ready.rank{rank}"
                if not ready.exists():
                    # Ready means every save so far is finished, uploads included (with tiering): the
                    # notice then finds them measured and nothing queued.
                    mgr.wait()
                    ready.write_text(str(os.getpid()))
                time.sleep(job.get("step_sleep_s", 0.02))
            if step in job.get("save_at", ()):
                mgr.save(step, state)
            try:
                mgr.maybe_save(step, state)
            except safepoint.Preempted as e:
                lag = mgr.durability_lag()
                log(
                    name,
                    "preempted",
                    step=e.step,
                    saved=e.saved_step,
                    code=e.code,
                    reason=e.reason,
                    durable=lag.durable_step,
                    pending=lag.uploads_pending,
                )
                if rank == 0:
                    torch.save(_local_state(model, opt, sched), out / f"{name}.preempted.pt")
                raise
            except safepoint.CheckpointError as e:
                since = time.monotonic() - noticed if vanishing and rank == 0 else None
                log(name, "collective_failed", step=step, error=type(e).__name__, msg=str(e), since=since)
                raise
    opts = StateDictOptions(full_state_dict=True)
    full = {
        "model": get_model_state_dict(model, options=opts),
        "optim": get_optimizer_state_dict(model, opt, options=opts),
    }
    if rank == 0:
        torch.save(full, out / f"{name}.final.pt")
    log(name, "finished", step=step)


if __name__ == "__main__":
    run_plan(train_job, _audit)
