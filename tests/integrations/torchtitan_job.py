"""A training job shaped like torchtitan 0.3's ``Trainer.train`` (trainer.py), on torchtitan's own parts.

torchtitan's ``Trainer`` itself imports triton (its kernels and overrides), which this CPU environment does
not install; everything the checkpointer touches is torchtitan's real code: the ``OptimizersContainer`` and
``LRSchedulersContainer`` built from their configs, a ``ParallelAwareDataloader`` (a ``StatefulDataLoader``)
and the checkpointer built by ``config.build(...)`` with the trainer's arguments, called where the trainer
calls it: ``load`` before the loop, ``maybe_wait_for_staging`` before ``optimizers.step``, ``save`` after
each step, ``close`` at the end. Dropout is on, so a resume is bitwise only if the RNG comes back too.

    python torchtitan_job.py --root DIR --steps N --save-every K [--step-sleep S] [--stop-after M]

Under torchrun (gloo) each rank reads its own data shard and the model is sharded with FSDP2's
``fully_shard``, as torchtitan's data parallelism does; rank 0 prints the losses.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import default_adamw

from safepoint.integrations.torchtitan import SafepointCheckpointManager
from tests.helpers.procs.exiting import run_then_exit


class Tokens(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """An endless stream of (input, label) rows, each drawn from its own index; rank r of w reads the rows
    r, r + w, ... Stateful like torchtitan's ``HuggingFaceTextDataset`` (its position is ``sample_idx``):
    ``StatefulDataLoader`` saves and restores it. (Without a state of its own a dataset is fast-forwarded,
    and torchdata 0.11 then counts the skipped batches twice in the next ``state_dict()``.)"""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        self.rank, self.world = rank, world
        self.sample_idx = 0

    def __iter__(self) -> Any:
        while True:
            g = torch.Generator().manual_seed(self.rank + self.sample_idx * self.world)
            self.sample_idx += 1
            x = torch.randn(8, generator=g)
            yield x, x.sum(dim=0, keepdim=True)

    def state_dict(self) -> dict[str, Any]:
        return {"sample_idx": self.sample_idx}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sample_idx = state_dict["sample_idx"]


class TrainState:
    """The trainer's own counters: what ``states={"train_state": trainer}`` saves."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


def build_loader(rank: int = 0, world: int = 1) -> ParallelAwareDataloader:
    # A generator of its own: a DataLoader without one draws its base seed from the global RNG each time
    # an iterator is made, which a resumed run does after the RNG is restored (the uninterrupted run did it
    # before step 1): with dropout on, that one draw would shift every later mask.
    gen = torch.Generator().manual_seed(0)
    return ParallelAwareDataloader(
        Tokens(rank, world), dp_rank=rank, dp_world_size=world, batch_size=4, generator=gen
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--sync", action="store_true")
    p.add_argument("--save-on-sigterm", action="store_true")
    p.add_argument("--stop-after", type=int, default=None, help="end the job after this step's save")
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    if world > 1:
        fully_shard(model)  # torchtitan's data parallelism: FSDP2 over the dp mesh (the whole world here)
        torch.manual_seed(rank)  # each rank its own dropout masks
    parts = [model]
    optimizers = default_adamw(lr=1e-2, implementation="for-loop").build(model_parts=parts)
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(
        optimizers=optimizers, training_steps=args.steps
    )
    dataloader = build_loader(rank, world)
    train_state = TrainState()
    config = SafepointCheckpointManager.Config(
        enable=True,
        folder="checkpoint",
        interval=args.save_every,
        async_save=not args.sync,
        save_on_sigterm=args.save_on_sigterm,
    )
    checkpointer = config.build(
        dataloader=dataloader,
        model_parts=parts,
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=args.root,
    )
    checkpointer.load(step=config.load_step)
    data = iter(dataloader)
    while train_state.step < args.steps:
        train_state.step += 1
        x, y = next(data)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        train_state.ntokens_seen += x.numel()
        if rank == 0:
            print(f"step {train_state.step} loss {loss.item()!r}", flush=True)
        checkpointer.save(train_state.step, last_step=train_state.step == args.steps)
        time.sleep(args.step_sleep)
        if train_state.step == args.stop_after:
            break
    checkpointer.close()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_then_exit(main)  # never through the teardown: tests/helpers/procs/exiting.py
