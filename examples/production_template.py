"""A production training job to copy: every piece a real run needs, wired to safepoint, in one file.

    torchrun --standalone --nproc-per-node=2 examples/production_template.py \
        --root /shared/ckpt --local-root /nvme/ckpt          # --root may be s3://bucket/run (tiering)

What is in it, top to bottom: a small GPT sharded with FSDP2 (``fully_shard``), a sharded EMA copy saved as
a named section, torchdata's ``StatefulDataLoader`` with 2 worker processes over ``ResumableSampler``,
gradient accumulation, bf16 autocast (``GradScaler`` with ``--precision fp16``), AdamW with two parameter
groups, linear warmup then cosine decay, gradient clipping, async saves into a fast local tier uploaded to a
durable root, and preemption: SIGTERM (from torchrun's agent, Slurm or Kubernetes) saves the current step
and exits 143. Kill it any way you like (a rank with ``kill -9`` included) and run the same command: it
continues bitwise where the newest checkpoint left it. NCCL and one GPU per rank when there are GPUs, gloo
on CPU; nothing else changes. The defaults train a toy model in seconds on a CPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import signal
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchdata.stateful_dataloader import StatefulDataLoader

import safepoint


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True, help="durable checkpoint root: a shared path or s3://bucket/run")
    p.add_argument(
        "--local-root", help="fast local tier (NVMe): saves commit here, then are uploaded to --root"
    )
    p.add_argument("--steps", type=int, default=200, help="optimizer steps of the whole run (LR schedule)")
    p.add_argument("--until", type=int, help="stop this launch after this step (default: --steps)")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--ema-decay", type=float, default=0.99)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per forward")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
    p.add_argument("--samples", type=int, default=512, help="sequences in the (synthetic) data set")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--heartbeat", help="directory: each rank writes rank<R>.json (step, pid) after each step")
    return p.parse_args()


# ---- the model: a GPT-like decoder -------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(0.1)  # draws from the torch RNG: safepoint restores it per rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(att))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln(x))
        return logits


def shard(model: GPT, mesh: DeviceMesh) -> None:
    # One FSDP unit per block (its parameters are all-gathered just for its forward and backward), then the
    # root for the rest. Each rank keeps 1/world of every parameter and of the optimizer state.
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


# ---- the data ----------------------------------------------------------------------------------------------


class Tokens(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Next-token prediction over fixed random sequences: a real job memory-maps its tokenised corpus."""

    def __init__(self, samples: int, seq: int, vocab: int) -> None:
        self.data = torch.randint(vocab, (samples, seq + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


def endless(loader: StatefulDataLoader, sampler: safepoint.ResumableSampler) -> Iterator[list[torch.Tensor]]:
    """Batches forever, a new shuffle each epoch. After a restore the loader's first iteration continues the
    saved epoch mid-way (an epoch that had ended yields nothing and the next one starts)."""
    while True:
        yield from loader
        sampler.set_epoch(sampler.epoch + 1)


# ---- the job -----------------------------------------------------------------------------------------------


def main() -> None:
    args = parse()
    # torchdata 0.11 under torch >= 2.9 warns on every loader it builds; harmless.
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    cuda = torch.cuda.is_available()
    # Not dist.init_process_group: safepoint's keys the rendezvous by torchrun attempt, so the workers that
    # torchrun --max-restarts starts after a crash do not read the dead attempt's addresses.
    safepoint.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    # The same full weights on every rank before sharding; the EMA starts as an exact copy.
    torch.manual_seed(0)
    model = GPT(args.vocab, args.seq, args.dim, args.layers, args.heads).to(device)
    ema = copy.deepcopy(model).requires_grad_(False)
    # From here on each rank draws its own streams (dropout, any augmentation). Seed all three RNGs: an
    # unseeded Python or NumPy RNG starts from OS entropy, so two runs could never be compared bitwise.
    # safepoint saves and restores them per rank (TrainState(rng=True), the default).
    random.seed(1 + rank)
    np.random.seed(1 + rank)
    torch.manual_seed(1 + rank)
    mesh = init_device_mesh(device.type, (world,))
    shard(model, mesh)
    shard(ema, mesh)  # sharded like the model: saved without a gather, resharded at another world size

    # Two parameter groups, built after fully_shard (the optimizer must hold the sharded parameters):
    # weight decay on matrices (linear and embedding weights), none on biases and LayerNorm gains (1-D).
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    # Linear warmup, then cosine decay to 10 % over the rest of --steps (not --until: a launch that stops
    # early must not change the schedule the run follows).
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=args.warmup),
            torch.optim.lr_scheduler.CosineAnnealingLR(
                opt, T_max=max(1, args.steps - args.warmup), eta_min=args.lr * 0.1
            ),
        ],
        milestones=[args.warmup],
    )

    # Mixed precision. bf16 has fp32's exponent range: gradients do not underflow, so no loss scaling.
    # fp16 does underflow, so it needs a GradScaler, whose state (the scale, the steps since it last grew)
    # must be checkpointed with the rest. A disabled scaler has no state to save, so it is only added then.
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")

    dataset = Tokens(args.samples, args.seq, args.vocab)
    # The sampler's position is global (all ranks together): a restore at any world size continues with
    # exactly the sequences not yet trained on. drop_last keeps every rank's batch count equal.
    sampler = safepoint.ResumableSampler(len(dataset), shuffle=True, seed=0, drop_last=True)
    # StatefulDataLoader's state is that of the batches the loop consumed, not of those its workers have
    # prefetched: a restore neither skips nor repeats a batch. generator=: without one, each new iterator
    # draws its workers' seed from the global torch RNG, which a resumed run (one more iterator) shifts.
    loader = StatefulDataLoader(
        dataset,
        batch_size=args.micro_batch,
        sampler=sampler,
        num_workers=args.workers,
        generator=torch.Generator(),
        pin_memory=cuda,  # page-locked batches: the copy to the GPU overlaps compute (non_blocking below)
    )

    # Everything the loop depends on, each under a stable name. The EMA is a named section: sharded like the
    # model (per-rank `extra` cannot hold DTensors). The RNGs (dropout) are saved per rank by default.
    counters = {"tokens_seen": 0}  # this rank's; saved per rank and restored into this same dict
    state = safepoint.TrainState(
        model=model,
        optimizer=opt,
        scheduler=sched,
        dataloader=loader,
        modules={"ema": ema},
        objects={"scaler": scaler} if scaler.is_enabled() else None,
        extra=counters,
    )

    until = min(args.until or args.steps, args.steps)
    with safepoint.CheckpointManager(
        args.root,
        local_root=args.local_root,  # commit locally (training goes on at once), upload in the background
        save_every_steps=args.save_every,
        keep=safepoint.Keep(last=3),
        async_save=True,  # the write overlaps training; only the staging copy blocks the loop
        # SIGTERM: torchrun's agent, Slurm and Kubernetes all send it before SIGKILL; SIGUSR1 is Slurm's
        # early warning (--signal=USR1@120). The next maybe_save saves that step on every rank, then raises
        # safepoint.Preempted (exit 143) for the scheduler to restart the job. DataLoader workers forked
        # while the manager is open are shielded from the group's signal: they serve until the save is done.
        preemption=safepoint.PreemptionOptions(signals=(signal.SIGTERM, signal.SIGUSR1)),
        resume="auto",  # "required" on a relaunch that must find a checkpoint (a typo'd root raises)
    ) as mgr:
        step = mgr.restore(state)  # 0 on a fresh run; resharded if the world size changed
        saved_at = step  # the newest checkpoint's step, the same on every rank
        if rank == 0:
            print(f"resumed at step {step} with {world} ranks", flush=True)
        batches = endless(loader, sampler)  # after the manager: its workers are forked shielded
        while step < until:
            model.train()
            loss_sum = torch.zeros((), device=device)
            for micro in range(args.accum):
                x, y = (t.to(device, non_blocking=True) for t in next(batches))
                # Reduce-scatter the gradients only on the last micro-batch: the others accumulate locally
                # (unsharded gradients stay in memory meanwhile, the usual trade for less communication).
                model.set_requires_gradient_sync(micro == args.accum - 1)
                with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                    logits = model(x)
                # The loss in fp32; divided so that the accumulated gradient is the mean over micro-batches.
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / args.accum
                scaler.scale(loss).backward()
                loss_sum += loss.detach()
                counters["tokens_seen"] += y.numel()
            scaler.unscale_(opt)  # clip the true gradients, not the scaled ones (a no-op unless fp16)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # global norm over all shards
            scaler.step(opt)  # skips the step if fp16 gradients overflowed
            scaler.update()
            opt.zero_grad(set_to_none=True)
            sched.step()
            update_ema(ema, model, args.ema_decay)
            step += 1
            if args.heartbeat:
                heartbeat(Path(args.heartbeat), rank, step)
            # Periodic (async) save every --save-every steps; on a preemption notice, the emergency save of
            # this step, then safepoint.Preempted. The loss as a tensor: .item() would wait for the GPU
            # every step, metrics are read only when a save happens.
            if mgr.maybe_save(step, state, metrics={"loss": loss_sum}):
                saved_at = step
        # Decided from what every rank did, not from a listing (on NFS a rank may not see the newest step yet
        # and would enter the collective save alone).
        if saved_at != step:
            mgr.save(step, state)  # the final state, so a rerun has nothing left to do
    # Leaving the `with` waited for the last async save and for its upload to the durable root.
    if rank == 0:
        print(f"finished at step {step}, tokens_seen={counters['tokens_seen']}", flush=True)
    dist.destroy_process_group()


@torch.no_grad()
def update_ema(ema: nn.Module, model: nn.Module, decay: float) -> None:
    # Shard by shard: both modules are sharded the same way, so this is local, no communication.
    for e, p in zip(ema.parameters(), model.parameters(), strict=True):
        e.lerp_(p, 1.0 - decay)


def heartbeat(directory: Path, rank: int, step: int) -> None:
    """A liveness file for a watchdog (or a test) to follow progress; written whole, then renamed."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".rank{rank}.tmp"
    tmp.write_text(json.dumps({"step": step, "pid": os.getpid()}))
    tmp.replace(directory / f"rank{rank}.json")


if __name__ == "__main__":
    code = 0
    try:
        main()
    except safepoint.Preempted as e:
        # A SystemExit whose code (143) tells torchrun/Slurm/Kubernetes to restart the job; caught here to say
        # what was saved.
        if os.environ.get("RANK", "0") == "0":
            print(f"preempted at step {e.step}, saved step {e.saved_step}, exiting {e.code}", flush=True)
        code = e.code
    # Everything is saved and closed: end here, without the interpreter's teardown, in which torch 2.13's gloo
    # threads can abort the process (SIGABRT instead of `code`; docs/elastic.md, "Ending a gloo job").
    sys.stdout.flush()
    os._exit(code)
