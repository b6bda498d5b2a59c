"""The training job that ``safepoint demo`` launches under torchrun (one rank per process).

    python -m torch.distributed.run --standalone --nproc-per-node=2 -m safepoint.demo.worker PLAN.json

A small causal transformer learns a generated next-token task, with DDP over gloo on CPU, a
``ResumableSampler`` feeding a ``DataLoader``, per-rank dropout RNG and async saves. PLAN.json is
``{"log": PREFIX, "jobs": [JOB, ...]}``: every event the demo reports is a JSON line in PREFIX.rank<R>.jsonl,
and the jobs run one after another in the same processes. A JOB:

    name           tags its events
    done           PATH: PATH.done marks the job finished, so a torchrun restart skips it
    root, steps    checkpoint root; train until this step
    total_steps    the schedule's length (the LR schedule depends on it)
    save_every     periodic saves every N steps
    snapshots      {step: path}: rank 0 writes the full model and optimizer state there after that step
    restore_step   restore exactly this step instead of the newest intact one (optional)
    kill / preempt {attempt, rank, after}: in that torchrun attempt, after that step, the rank announces
                   itself (a ``kill-ready`` / ``preempt-ready`` event with its pid) and waits for the
                   driver's SIGKILL, or trains slowly until its SIGTERM has landed

The signals themselves come from the driver (safepoint.demo.main): this job only reports what happened to it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
import warnings
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
from torch.utils.data import DataLoader, TensorDataset

import safepoint
from safepoint.demo.procs import die_with_parent, parent_of

VOCAB, DIM, SEQ, LAYERS = 64, 64, 32, 2
DATASET_SIZE, BATCH_PER_RANK = 384, 8
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
# After announcing a preemption a rank trains this slowly (the ranks must reach maybe_save to act on the
# notice) until the driver's SIGTERM lands; a rank announcing a kill waits up to _KILL_WAIT_S for it.
_SLOW_STEP_S = 0.1
_KILL_WAIT_S = 120.0


class TinyTransformer(nn.Module):
    """A causal language model: a couple of pre-norm layers, d_model 64; fast on two CPU cores."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        layer = nn.TransformerEncoderLayer(
            DIM, nhead=4, dim_feedforward=4 * DIM, dropout=0.1, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(x) + self.pos, mask=self.mask, is_causal=True)
        out: torch.Tensor = self.head(h)
        return out


def generated_dataset() -> TensorDataset:
    """Sequences x[t+1] = (a * x[t] + b) mod VOCAB with a, b drawn per sequence: the same on every rank."""
    gen = torch.Generator().manual_seed(1234)
    a = torch.randint(1, 8, (DATASET_SIZE, 1), generator=gen)
    b = torch.randint(0, VOCAB, (DATASET_SIZE, 1), generator=gen)
    seq = torch.empty(DATASET_SIZE, SEQ + 1, dtype=torch.long)
    seq[:, :1] = torch.randint(0, VOCAB, (DATASET_SIZE, 1), generator=gen)
    for t in range(SEQ):
        seq[:, t + 1 : t + 2] = (a * seq[:, t : t + 1] + b) % VOCAB
    return TensorDataset(seq[:, :-1], seq[:, 1:])


class Log:
    def __init__(self, prefix: str, rank: int) -> None:
        self.path = Path(f"{prefix}.rank{rank}.jsonl")
        self.rank = rank
        self.job = "-"

    def __call__(self, event: str, **fields: Any) -> None:
        record = {"event": event, "job": self.job, "rank": self.rank, "attempt": ATTEMPT, "t": time.time()}
        record.update(fields)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    opts = StateDictOptions(full_state_dict=True)
    return {
        "model": get_model_state_dict(model, options=opts),
        "optim": get_optimizer_state_dict(model, opt, options=opts),
    }


def _trigger(job: dict[str, Any], key: str, rank: int, step: int) -> bool:
    spec = job.get(key) or {}
    return bool(spec) and (spec["attempt"], spec["rank"], spec["after"]) == (ATTEMPT, rank, step)


def train(job: dict[str, Any], log: Log) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.parallel.DistributedDataParallel(TinyTransformer())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=job["total_steps"], eta_min=3e-4)
    sampler = safepoint.ResumableSampler(DATASET_SIZE, shuffle=True, seed=0)
    # A private generator: the DataLoader draws a seed from it whenever an iterator starts, and drawing
    # from the global RNG would shift the dropout stream of a resumed run against an uninterrupted one.
    loader = DataLoader(
        generated_dataset(), batch_size=BATCH_PER_RANK, sampler=sampler, generator=torch.Generator()
    )
    for seed in (random.seed, np.random.seed, torch.manual_seed):
        seed(1000 + rank)  # every rank its own dropout stream
    state = safepoint.TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=sampler, rng=True)
    snapshots = {int(k): v for k, v in job.get("snapshots", {}).items()}
    with safepoint.CheckpointManager(
        job["root"],
        save_every_steps=job["save_every"],
        async_save=True,
        cluster=safepoint.ClusterOptions(collective_timeout_s=60),
        preemption=safepoint.PreemptionOptions(signals=(signal.SIGTERM,)),
    ) as mgr:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", safepoint.CheckpointWarning)
            step = mgr.restore(state, step=job.get("restore_step"))
        for w in caught:
            if issubclass(w.category, safepoint.CheckpointWarning):
                print(f"rank {rank}: CheckpointWarning: {w.message}", file=sys.stderr, flush=True)
                log("fallback", message=str(w.message))
        saved_world = next((c.world_size for c in mgr.list() if c.step == step), None)
        log("restored", step=step, world_size=world, saved_world_size=saved_world, pid=os.getpid())
        slow = False
        while step < job["steps"]:
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
                opt.zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                step += 1
                if rank == 0:
                    log("step", step=step, loss=round(loss.item(), 4))
                if _trigger(job, "kill", rank, step):
                    log("kill-ready", step=step, pid=os.getpid())
                    # Wait here for the driver's SIGKILL (the other rank waits in the next all-reduce):
                    # the kill lands after exactly this step, whenever the driver gets to it.
                    deadline = time.monotonic() + _KILL_WAIT_S
                    while time.monotonic() < deadline:
                        time.sleep(0.05)
                if _trigger(job, "preempt", rank, step):
                    log("preempt-ready", step=step, pid=os.getpid())
                    slow = True
                if slow:
                    time.sleep(_SLOW_STEP_S)
                n_saves = len(mgr.saves)
                try:
                    saved = mgr.maybe_save(step, state, metrics={"loss": loss.detach()})
                except safepoint.Preempted as e:
                    rec = mgr.saves[-1] if len(mgr.saves) > n_saves else None  # the emergency save
                    log(
                        "preempted",
                        step=e.step,
                        saved_step=e.saved_step,
                        resume_step=e.resume_step,
                        code=e.code,
                        reason=e.reason,
                        blocking_ms=rec.blocking_s * 1000 if rec else None,
                    )
                    raise
                if saved and rank == 0:
                    rec = mgr.saves[-1]
                    log("save", step=step, blocking_ms=rec.blocking_s * 1000, bytes=rec.bytes)
                if step in snapshots:
                    snap = full_state(model, opt)
                    if rank == 0:
                        torch.save(snap, snapshots[step])
                if step >= job["steps"]:
                    break
            else:
                sampler.set_epoch(sampler.epoch + 1)
    log("finished", step=step)


def main() -> None:
    # Under safepoint.demo.main: die with torchrun (it is SIGKILLed if the demo dies), and at once if torchrun
    # is no longer the demo's child already. torchrun alone would leave its workers running then.
    demo = os.environ.get("SAFEPOINT_DEMO_PID")
    if demo:
        die_with_parent(signal.SIGKILL, lambda ppid: parent_of(ppid) == int(demo))
    plan = json.loads(Path(sys.argv[1]).read_text())
    # Keys the rendezvous store by torchrun attempt, so a restarted rank never reads a dead peer's address.
    safepoint.init_process_group("gloo", timeout_s=60)
    log = Log(plan["log"], dist.get_rank())
    log("start", pid=os.getpid(), world_size=dist.get_world_size())
    for job in plan["jobs"]:  # jobs run one after the other in the same processes, each from scratch
        done = Path(job["done"] + ".done") if job.get("done") else None
        if done and done.exists():
            continue  # finished in an earlier torchrun attempt
        log.job = job["name"]
        train(job, log)
        dist.barrier()
        if done and dist.get_rank() == 0:
            done.touch()
    dist.destroy_process_group()


if __name__ == "__main__":
    code = 0
    try:
        main()
    except safepoint.Preempted as e:  # saved and closed: 143 tells the orchestrator to restart the job
        code = e.code
    # End without the interpreter's teardown, in which torch 2.13's gloo threads can abort the process
    # (SIGABRT instead of `code`; docs/elastic.md, "Ending a gloo job").
    sys.stdout.flush()
    os._exit(code)
