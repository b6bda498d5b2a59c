"""DistributedDataParallel under torchrun, resumable after a crash and at a different number of ranks.

    torchrun --standalone --nproc-per-node=2 examples/ddp.py ckpt
    torchrun --standalone --nproc-per-node=1 examples/ddp.py ckpt --steps 300   # resumes with 1 rank

NCCL on GPUs, gloo on CPU: the program is the same. Kill it (or one rank) at any time and run it again.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import safepoint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", help="checkpoint directory, shared by every rank")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-every", type=int, default=50)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    # Not dist.init_process_group: this one also survives torchrun --max-restarts (docs/elastic.md).
    safepoint.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    # A toy regression data set, the same on every rank.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=g)
    dataset = TensorDataset(x, x @ torch.randn(16, 1, generator=g))
    # Like DistributedSampler, but its position is global: a restore continues with the next unseen
    # samples at any world size.
    sampler = safepoint.ResumableSampler(len(dataset), shuffle=True, seed=0)
    # A generator of its own: without one, every new iterator draws a seed from the global torch RNG,
    # which shifts the RNG stream of a resumed run (docs/elastic.md).
    loader = DataLoader(dataset, batch_size=16, sampler=sampler, generator=torch.Generator())

    torch.manual_seed(0)  # reproducible initial weights (DDP copies rank 0's to every rank)
    model = DistributedDataParallel(
        torch.nn.Linear(16, 1).to(device), device_ids=[device.index] if cuda else None
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = safepoint.TrainState(model=model, optimizer=opt, dataloader=sampler)

    # Every rank constructs the manager, restores and saves at the same steps; rank 0 commits.
    with safepoint.CheckpointManager(
        args.root, save_every_steps=args.save_every, keep=safepoint.Keep(last=2)
    ) as mgr:
        step = mgr.restore(state)  # the same step on every rank; 0 on a fresh run
        saved_at = step  # the step of the newest checkpoint, the same on every rank
        if rank == 0:
            print(f"resumed at step {step} with {world} ranks", flush=True)
        batches = endless(loader, sampler)
        while step < args.steps:
            xb, yb = (t.to(device) for t in next(batches))
            loss = (model(xb) - yb).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            # A tensor, not loss.item(): that would wait for the GPU every step; metrics are read on a save.
            if mgr.maybe_save(step, state, metrics={"loss": loss.detach()}):
                saved_at = step
        # Decided from what every rank did, not from a directory listing (on NFS one rank may not see the
        # newest step yet, and would enter the collective save alone).
        if saved_at != step:
            mgr.save(step, state)  # the final state, so a rerun has nothing left to do
    if rank == 0:
        print(f"finished at step {step}", flush=True)
    dist.destroy_process_group()


def endless(loader: DataLoader[Any], sampler: safepoint.ResumableSampler) -> Iterator[list[torch.Tensor]]:
    """Batches forever, a new shuffle each epoch; the first epoch after a restore continues mid-way."""
    while True:
        yield from loader
        sampler.set_epoch(sampler.epoch + 1)


if __name__ == "__main__":
    main()
    # Everything is saved and closed: end without the interpreter's teardown, in which torch 2.13's gloo
    # threads can abort the process (docs/elastic.md, "Ending a gloo job").
    sys.stdout.flush()
    os._exit(0)
