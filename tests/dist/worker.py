"""A torchrun worker that runs a list of small distributed training jobs, for tests/dist/test_distributed.py.

    python -m torch.distributed.run --standalone --nproc-per-node=N [--max-restarts=R] worker.py PLAN.json

PLAN.json: {"out": DIR, "jobs": [JOB, ...]}, run by tests.helpers.torchrun.run_plan: jobs in order; a job that
finished in an earlier attempt (its ``DIR/<name>.done`` exists) is skipped, so a torchrun restart resumes
the interrupted job and goes on. Faults are real: SIGKILL of the process, or a rank blocking inside
``open()`` of its own checkpoint file (found with a CPython audit hook), only in the attempt named by the
job. Everything the test checks is written under DIR: JSON lines per rank (``log.rank<R>.jsonl``) and full
state dicts (``*.pt``).
"""

from __future__ import annotations

import os
import random
import signal
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
from torch.utils.data import DataLoader, Dataset

import safepoint
from safepoint.dist import Agreement, Comm
from safepoint.store.posix_layout import Layout
from tests.helpers.torchrun import ATTEMPT, Log, run_plan, seed_all

_FAULT: dict[str, Any] = {}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    """Acts when this rank opens its own data file of the save named in _FAULT (a real mid-save fault)."""
    if event != "open" or not _FAULT or not isinstance(args[0], str):
        return
    path, flags = args[0], args[2] if len(args) > 2 else None
    # The data file is created by a walk from the root (store/rootfs.py): os.open of its bare name in the
    # save's directory (dir_fd), O_CREAT; only the save armed in _FAULT creates this rank's file by that name.
    created_here = os.sep not in path and isinstance(flags, int) and flags & os.O_CREAT
    if path.endswith(_FAULT["suffix"]) and (_FAULT["pending"] in path or created_here):
        if _FAULT["action"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)  # a hung file system: the others must give up after the collective timeout


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


class Points(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(123)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randn(n, 2, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


class Position:
    """A per-rank Stateful data position (what a rank-local reader would keep)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.value = int(sd["value"])


def build(kind: str, ws: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # the same initial weights on every rank
    model: nn.Module = Tiny()
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (ws,))
        assert isinstance(model, Tiny)
        for layer in (model.net[0], model.net[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    elif kind != "plain":
        raise ValueError(kind)
    return model


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole model and optimizer state, gathered on every rank (collective).

    cpu_offload=True is avoided: with FSDP1 and parameters already on the CPU it segfaults (torch 2.13).
    """
    opts = StateDictOptions(full_state_dict=True)
    return {
        "model": get_model_state_dict(model, options=opts),
        "optim": get_optimizer_state_dict(model, opt, options=opts),
    }


def dump(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    sd = full_state(model, opt)
    if dist.get_rank() == 0:
        torch.save(sd, path)


def train_job(job: dict[str, Any], out: Path, log: Log) -> None:
    name, kind = job["name"], job["model"]
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = build(kind, ws)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    seed_all(1000 + rank)  # every rank its own dropout and data stream
    sampler = loader = None
    if "samples" in job:
        sampler = safepoint.ResumableSampler(job["samples"], seed=7)
        loader = DataLoader(Points(job["samples"]), batch_size=2, sampler=sampler)
    extra: dict[str, Any] = {"rank_seen": 0}
    state = safepoint.TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=sampler, extra=extra)
    mgr = safepoint.CheckpointManager(
        job["root"],
        save_every_steps=job.get("save_every"),
        save_every_seconds=job.get("save_every_s"),
        cluster=safepoint.ClusterOptions(collective_timeout_s=job.get("timeout_s", 30.0)),
        async_save=job.get("async_writer") is not None,
        writer=safepoint.WriterOptions(async_writer=job.get("async_writer", "thread")),
        keep=safepoint.Keep(last=job.get("keep_last")),
    )
    if job.get("async_writer") == "process" and mgr._process is not None:
        mgr._process.wait_ready()  # every save by the process (those before ready go to the thread)
    committed = [c.step for c in mgr.list()]
    step = mgr.restore(state)
    log(name, "restored", step=step, committed=committed, world_size=ws, seen=extra["rank_seen"])
    if job.get("log_rng"):
        log(name, "rng_start", draw=torch.rand(3).tolist())
    if job.get("dump_restored"):
        dump(out / f"{name}.restored.pt", model, opt)
    batches = _batches(sampler, loader) if sampler is not None and loader is not None else None
    kill, fault = job.get("kill"), job.get("fault")
    while step < job["steps"]:
        if batches is not None:
            idx, x, y = next(batches)
            log(name, "batch", step=step + 1, indices=idx.tolist())
        else:
            x = torch.randn(4, 8) + float(np.random.rand()) + random.random()
            y = torch.randn(4, 2)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        if kind == "plain":
            # A replicated plain model: average gradients by hand, as DDP would.
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad /= ws
        opt.step()
        sched.step()
        extra["rank_seen"] += len(x)
        step += 1
        if job.get("step_sleep_s"):
            time.sleep(job["step_sleep_s"])
        if job.get("rank0_extra_s") and rank == 0:
            # Rank-0-only work (logging, eval) between the step and maybe_save: the ranks call maybe_save
            # at different times, so a time-based policy alone would see the interval pass at different
            # steps on the two ranks.
            time.sleep(job["rank0_extra_s"])
        if kill and kill["attempt"] == ATTEMPT and rank == kill["rank"] and step == kill["step"]:
            os.kill(os.getpid(), signal.SIGKILL)
        if fault and (fault["attempt"], fault["rank"], fault["step"]) == (ATTEMPT, rank, step):
            _FAULT.update(
                pending=os.path.join(job["root"], ".pending", f"step-{step}-"),
                suffix=f"__{rank}_0.distcp",
                action=fault["action"],
            )
        t0 = time.monotonic()
        try:
            mgr.maybe_save(step, state, metrics={"loss": float(loss.detach())})
        except safepoint.CheckpointError as e:
            log(
                name,
                "save_failed",
                step=step,
                elapsed=time.monotonic() - t0,
                error=type(e).__name__,
                msg=str(e),
            )
            raise
    process, written = mgr._process, {}
    if process is not None:
        mgr.wait()  # the last save's write counted too
        written = {"writes": process.writes, "descriptions": process.descriptions}
    log(name, "saves", steps=[s.step for s in mgr.saves], checks=mgr._agreement.checks, **written)
    mgr.close()
    if job.get("log_rng"):
        log(name, "rng_end", draw=torch.rand(3).tolist())
    dump(out / f"{name}.final.pt", model, opt)
    if job.get("reload"):
        # A fresh model (other initial weights) restored from the final checkpoint at the same world size.
        model = build(kind, ws, seed=99)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        state = safepoint.TrainState(model=model, optimizer=opt, scheduler=sched, extra={"rank_seen": 0})
        with safepoint.CheckpointManager(job["root"]) as again:
            log(name, "reloaded", step=again.restore(state), scheduler=sched.state_dict()["last_epoch"])
        dump(out / f"{name}.reloaded.pt", model, opt)


def _batches(sampler: safepoint.ResumableSampler, loader: DataLoader[Any]) -> Any:
    while True:
        yield from loader
        sampler.set_epoch(sampler.epoch + 1)


def rng_job(job: dict[str, Any], out: Path, log: Log) -> None:
    """Two ranks with different RNG streams and positions each get their own back."""
    name, rank = job["name"], dist.get_rank()
    seed_all(50 + rank)
    torch.rand(5)
    position = Position(100 + rank)
    extra: dict[str, Any] = {"marker": f"rank{rank}"}
    state = safepoint.TrainState(dataloader=position, extra=extra)
    with safepoint.CheckpointManager(job["root"]) as mgr:
        mgr.save(1, state)
        expected = [torch.rand(3).tolist(), np.random.rand(2).tolist(), random.random()]
        seed_all(0)
        position.value, extra["marker"] = -1, "lost"
        mgr.restore(state)
        got = [torch.rand(3).tolist(), np.random.rand(2).tolist(), random.random()]
    log(name, "rng", expected=expected, got=got, position=position.value, marker=extra["marker"])


def nodelocal_job(job: dict[str, Any], out: Path, log: Log) -> None:
    """Ranks that do not share the checkpoint root, as on nodes with node-local disks.

    Saving must not commit (rank 0 cannot see rank 1's shard); restoring a checkpoint that only rank 0 can
    see must say so instead of calling it corrupt and silently starting over.
    """
    name, rank = job["name"], dist.get_rank()
    model = build("ddp", dist.get_world_size())
    state = safepoint.TrainState(model=model)
    with safepoint.CheckpointManager(os.path.join(job["root"], f"node{rank}")) as mgr:
        try:
            mgr.save(1, state)
            log(name, "saved")
        except safepoint.SaveError as e:
            log(name, "save_failed", msg=str(e))
    shared = os.path.join(job["root"], "shared")
    with safepoint.CheckpointManager(shared) as mgr:
        mgr.save(1, state)
    # The job moves: rank 0 still sees the checkpoint, rank 1 now looks at an empty local disk.
    with safepoint.CheckpointManager(shared if rank == 0 else os.path.join(job["root"], "empty")) as mgr:
        try:
            log(name, "restored", step=mgr.restore(state))
        except safepoint.CheckpointError as e:
            log(name, "restore_failed", error=type(e).__name__, msg=str(e))


def fallback_job(job: dict[str, Any], out: Path, log: Log) -> None:
    """A bad file in rank 1's share of the verification: every rank falls back to the older step."""
    name, rank, ws = job["name"], dist.get_rank(), dist.get_world_size()
    model = build("fsdp2", ws)
    state = safepoint.TrainState(model=model, rng=False)
    with safepoint.CheckpointManager(job["root"]) as mgr:
        mgr.save(3, state)
        mgr.save(6, state)
    names = sorted(Layout(job["root"]).read_manifest(6).files)
    victim = next(n for n in names[1::ws] if n.endswith(".distcp"))  # verified by rank 1 only
    if rank == 0:
        path = Path(job["root"]) / "step-6" / victim
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with safepoint.CheckpointManager(job["root"]) as mgr:
            step = mgr.restore(state)
    log(name, "restored", step=step, victim=victim, warnings=[str(w.message) for w in caught])


def agreement_job(job: dict[str, Any], out: Path, log: Log) -> None:
    """A level-triggered flag raised on one rank only is acted on by all, at the same step."""
    name, rank = job["name"], dist.get_rank()
    comm = Comm(30.0)
    agreement = Agreement(comm, job["target_s"])
    raised_at, agreed = job["raise_at"], []
    pending = None
    for step in range(1, job["steps"] + 1):
        time.sleep(job["step_sleep_s"])
        if rank == 1 and step in raised_at:
            pending = step
        if agreement.agree(step, pending is not None):
            agreed.append(step)
            pending = None
    log(name, "agreed", agreed=agreed, checks=agreement.checks)
    comm.destroy()


JOBS = {
    "train": train_job,
    "rng": rng_job,
    "nodelocal": nodelocal_job,
    "fallback": fallback_job,
    "agreement": agreement_job,
}


def run_job(job: dict[str, Any], out: Path, log: Log) -> None:
    JOBS[job.get("kind", "train")](job, out, log)


if __name__ == "__main__":
    run_plan(run_job, _audit)
