"""A multi-rank Lightning job for tests/integrations/test_lightning_ranks.py: a tiny model with dropout on
``--devices`` CPU ranks (gloo; Lightning launches the other ranks itself), ``--strategy ddp``, ``mp``
(``ModelParallelStrategy``, the model ``fully_shard``-ed in ``configure_model``: FSDP2) or ``fsdp-sharded`` /
``fsdp-full`` (Lightning's ``FSDPStrategy`` with that ``state_dict_type``, FSDP1, through ``CPUFSDPStrategy``
below), a ``ResumableSampler`` per rank, ``SafepointCallback`` saving every ``--save-every`` steps.

    python tests/integrations/lightning_ranks_job.py --root DIR --strategy mp --devices 2 --steps 8 \
        [--save-every 2] [--out final.pt] [--step-sleep S]

Each rank prints ``rank R step N loss V`` per optimizer step. With ``--out``, the full (gathered) weights and
optimizer state at the end of ``fit`` go to that file (rank 0 writes it), for a bitwise comparison.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import safepoint
from safepoint.integrations.lightning import SafepointCallback

SAMPLES, BATCH = 24, 2  # per rank and epoch: 6 batches with 2 ranks, 12 with 1
STRATEGIES = ("ddp", "mp", "fsdp-sharded", "fsdp-full")


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's own ``FSDPStrategy``, unchanged, so that it runs on CPU ranks (gloo).

    Lightning refuses ``FSDPStrategy`` with ``accelerator="cpu"``, but only by an exact type check
    (``type(strategy) is FSDPStrategy`` in its accelerator connector); the strategy itself handles a CPU root
    device (``device_id=None`` for FSDP1), and torch's FSDP1 trains on the CPU with gloo. A subclass passes
    that check, so every line of the strategy that runs (wrapping, state dicts, DCP) is Lightning's."""


class Net(L.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.Linear(16, 1))

    def configure_model(self) -> None:
        if self.args.strategy == "mp":
            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net[0], mesh=mesh)
            fully_shard(self.net, mesh=mesh)
        elif self.args.strategy.startswith("fsdp-"):
            # Wrapped here, as Lightning allows (it then skips its own wrap), because its own wrap passes
            # ``device_id=root_device.index``: None on the CPU, and FSDP1 then looks for an accelerator.
            cpu = torch.device("cpu")
            self.net[0] = FSDP(self.net[0], device_id=cpu, use_orig_params=True)
            self.net = FSDP(self.net, device_id=cpu, use_orig_params=True)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(SAMPLES, 4, generator=g), torch.randn(SAMPLES, 1, generator=g))
        rank, world = self.trainer.global_rank, self.trainer.world_size
        sampler = safepoint.ResumableSampler(SAMPLES, seed=0, rank=rank, world_size=world)
        return DataLoader(data, batch_size=BATCH, sampler=sampler)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        # One write per line: both ranks share the pipe, and a write under PIPE_BUF is never split.
        sys.stdout.write(f"rank {self.global_rank} step {self.global_step + 1} loss {loss.item()!r}\n")
        sys.stdout.flush()
        if self.args.step_sleep:
            time.sleep(self.args.step_sleep)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_fit_end(self) -> None:
        if not self.args.out:
            return
        # No cpu_offload for FSDP1: its full state dict with offload_to_cpu segfaulted on CPU ranks (torch
        # 2.13, gloo); the tensors are on the CPU already.
        fsdp1 = self.args.strategy.startswith("fsdp-")
        full = StateDictOptions(full_state_dict=True, cpu_offload=not fsdp1)
        model = self.trainer.strategy.model
        weights, optim = get_state_dict(model, self.trainer.optimizers, options=full)  # collective
        if self.global_rank == 0:
            torch.save({"model": weights, "optim": optim, "step": self.global_step}, self.args.out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--strategy", choices=STRATEGIES, required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--out", default="")
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()

    L.seed_everything(0, verbose=False)
    if args.strategy == "mp":
        strategy: Any = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    elif args.strategy.startswith("fsdp-"):
        kind = args.strategy.removeprefix("fsdp-")
        strategy = CPUFSDPStrategy(state_dict_type=kind, process_group_backend="gloo")
    else:
        strategy = DDPStrategy(process_group_backend="gloo")
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        use_distributed_sampler=False,  # the ResumableSampler splits the data between the ranks
        callbacks=[SafepointCallback(args.root, save_every_steps=args.save_every)],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(args))


if __name__ == "__main__":
    main()
