"""A torchrun worker for tests/test_sections.py: FSDP2 with named sections (an EMA copy, a second model with
its own optimizer, a named Stateful object), saved at one world size and restored at another.

    python -m torch.distributed.run --standalone --nproc-per-node=N sections_worker.py PLAN.json

A JOB: ``name``, ``root``, ``mode`` ("save": train 3 steps, check that a sharded module in ``extra`` is
refused when the TrainState is built, save step 3; "load": build fresh (other seeds) and restore). Rank 0
writes the gathered state right after the save or the restore to ``DIR/<name>.pt``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import safepoint
from tests.dist.worker import Position, build, full_state
from tests.helpers.torchrun import Log, run_plan


def _no_audit(event: str, args: tuple[Any, ...]) -> None:
    pass


def _gathered(model: nn.Module, opt: Any, ema: nn.Module, disc: nn.Module, disc_opt: Any) -> dict[str, Any]:
    return {
        "main": full_state(model, opt),
        "ema": get_model_state_dict(ema, options=StateDictOptions(full_state_dict=True)),
        "disc": full_state(disc, disc_opt),
    }


def sections_job(job: dict[str, Any], out: Path, log: Log) -> None:
    ws, rank, saving = dist.get_world_size(), dist.get_rank(), job["mode"] == "save"
    seed = 0 if saving else 7  # a restore must replace every value
    model, ema, disc = build("fsdp2", ws, seed), build("fsdp2", ws, seed), build("fsdp2", ws, seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    disc_opt = torch.optim.AdamW(disc.parameters(), lr=1e-3)
    meta = Position(0)
    if saving:
        try:
            safepoint.TrainState(model=model, optimizer=opt, extra={"ema": ema})
            log(job["name"], "extra_accepted")
        except ValueError as e:
            log(job["name"], "extra_refused", msg=str(e))
    state = safepoint.TrainState(
        model=model,
        optimizer=opt,
        modules={"ema": ema, "disc": disc},
        optimizers={"disc": disc_opt},
        objects={"meta": meta},
    )
    with safepoint.CheckpointManager(
        job["root"], cluster=safepoint.ClusterOptions(collective_timeout_s=60)
    ) as mgr:
        if saving:
            torch.manual_seed(100 + rank)
            for step in range(1, 4):
                x = torch.randn(4, 8)
                for m, o in ((model, opt), (disc, disc_opt)):
                    loss = (m(x) ** 2).mean()
                    o.zero_grad()
                    loss.backward()
                    o.step()
                with torch.no_grad():
                    for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                        e.lerp_(p, 0.1)
                meta.value = step * 10
            mgr.save(3, state)
            restored = 3
        else:
            restored = mgr.restore(state)
    gathered = _gathered(model, opt, ema, disc, disc_opt)
    if rank == 0:
        torch.save({**gathered, "meta": meta.value}, out / f"{job['name']}.pt")
    log(job["name"], "done", step=restored, world_size=ws)


if __name__ == "__main__":
    run_plan(sections_job, _no_audit)
