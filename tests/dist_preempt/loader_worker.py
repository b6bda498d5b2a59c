"""A torchrun worker for tests/preempt/test_preemption_loader.py: a DDP job reading through a DataLoader with worker
processes, preempted by SIGTERM to torchrun's agent (which signals each rank's whole process group, so the
loader's workers get it too).

    python -m torch.distributed.run --standalone --nproc-per-node=2 loader_worker.py PLAN.json

A JOB (see tests.helpers.torchrun.run_plan): ``name``, ``root``, ``steps``, ``loader`` ("torch":
``torch.utils.data.DataLoader`` over a ``ResumableSampler`` reporting consumption with ``advance``;
"stateful": torchdata's ``StatefulDataLoader`` in the TrainState), ``workers`` (num_workers),
``preempt`` (SIGTERM as the notice), ``ready_after`` (write ``<name>.ready.rank<R>`` after this many steps
and go on training slowly until signalled), ``shield`` (false: opt out of safepoint's worker shield).

Written under DIR: JSON lines per rank, rank 0's final model and optimizer (``<name>.final.pt``) and, when
preempted, rank 0's state at the emergency save (``<name>.preempted.pt``).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import safepoint
from tests.helpers.torchrun import Log, run_plan, seed_all

BATCH = 4


def _no_audit(event: str, args: tuple[Any, ...]) -> None:
    pass


def train_job(job: dict[str, Any], out: Path, log: Log) -> None:
    name, rank = job["name"], dist.get_rank()
    torch.manual_seed(0)  # the same initial weights and data on every rank
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 2))
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seed_all(1000 + rank)
    sampler = safepoint.ResumableSampler(len(data), seed=3, drop_last=True)
    kind, workers = job.get("loader", "torch"), job.get("workers", 2)
    loader: DataLoader[Any]
    # A generator of its own: iter(loader) draws the workers' base seed from it, not from the global RNG that
    # the TrainState restores (a resumed run calls iter() mid-epoch, an uninterrupted one does not).
    common = {"batch_size": BATCH, "sampler": sampler, "num_workers": workers, "generator": torch.Generator()}
    if kind == "stateful":
        loader = StatefulDataLoader(data, **common)
        state = safepoint.TrainState(model=model, optimizer=opt, dataloader=loader)
    else:
        loader = DataLoader(data, **common)
        state = safepoint.TrainState(model=model, optimizer=opt, dataloader=sampler)
    signals = (signal.SIGTERM,) if job.get("preempt") else ()
    preemption = safepoint.PreemptionOptions(signals=signals, shield_workers=job.get("shield", True))
    with safepoint.CheckpointManager(
        job["root"],
        preemption=preemption,
        cluster=safepoint.ClusterOptions(collective_timeout_s=30),
    ) as mgr:
        # Batches in a whole epoch, taken before the restore: afterwards len() is the rest of the restored
        # epoch, and ``step // len(loader)`` would jump to a later epoch once a run is preempted past the
        # middle of one (a loaded machine gets that far before the notice lands).
        per_epoch = len(loader)
        step = mgr.restore(state)
        log(name, "restored", step=step)
        start = step
        while step < job["steps"]:
            sampler.set_epoch(step // per_epoch)  # the same epoch keeps the restored position
            for x, y in loader:
                loss = ((model(x) - y) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                if kind == "torch":
                    sampler.advance(BATCH)
                if "ready_after" in job and step - start >= job["ready_after"]:
                    ready = out / f"{name}.ready.rank{rank}"
                    if not ready.exists():
                        ready.write_text(str(os.getpid()))
                    time.sleep(0.02)
                try:
                    mgr.maybe_save(step, state)
                except safepoint.Preempted as e:
                    log(name, "preempted", step=e.step, saved=e.saved_step, code=e.code, reason=e.reason)
                    if rank == 0:
                        torch.save({"model": model.module.state_dict()}, out / f"{name}.preempted.pt")
                    raise
                if step >= job["steps"]:
                    break
    if rank == 0:
        final = {"model": model.module.state_dict(), "optim": opt.state_dict()}
        torch.save(final, out / f"{name}.final.pt")
    log(name, "finished", step=step)


if __name__ == "__main__":
    run_plan(train_job, _no_audit)
