"""A torchrun worker for tests/dist/test_nodes.py: FSDP2 training with per-node local tiers.

    torchrun ... nodes_worker.py CONFIG.json        (local_root from $NODE_LOCAL_ROOT, one per agent)

CONFIG: {"out", "durable", "end", "save_every", and optionally "restore_only", "block_at", "pause_at",
"tag", "width" (of the hidden layer, 16 by default), "storage_options" (for a URL durable tier)}. The job trains a tiny FSDP2 model on 24 samples through ``ResumableSampler`` (2 per rank per step)
until step ``end``, saving every ``save_every`` steps, then waits for its uploads and rank 0 dumps the
full state to OUT/<tag>.pt. Every restore and every step's samples are JSON lines in OUT/log.jsonl.

- ``restore_only``: restore, log where each file came from, dump, end.
- ``restores``: [{"tag", "remove": [PATH, ...]}, ...]: restore-only phases in one launch, each with a fresh
  model and manager as a new launch would have; before a phase rank 0 removes its ``remove`` trees (a node
  losing its disk), between barriers.
- ``block_at`` K (world size ``full``, 2 by default, until OUT/blocked exists): after step K, wait for the uploads, write
  OUT/blocked (the workers' pids) and wait in a collective that only a dead peer ends (the test kills a
  node then).
- ``pause_at`` J (world size ``full // 2``): after step J (a save step), wait for the uploads, write OUT/paused and
  sleep until the agent stops this worker (the test adds a node).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

import safepoint
from tests.helpers.procs.exiting import run_then_exit

SAMPLES = 24


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    out = Path(cfg["out"])
    safepoint.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = uuid.uuid4().hex[:8] if rank == 0 else ""
    box = [gen]
    dist.broadcast_object_list(box, src=0)
    gen = box[0]

    def log(event: str, **fields: object) -> None:
        record = {"event": event, "rank": rank, "world": world, "gen": gen, "host": socket.gethostname()}
        record["local"] = os.environ["NODE_LOCAL_ROOT"]  # names the node, host name or not
        with open(out / "log.jsonl", "a") as f:
            f.write(json.dumps({**record, **fields}) + "\n")

    if "restores" in cfg:  # one launch, several restores: each phase as a fresh launch would restore
        for phase in cfg["restores"]:
            dist.barrier()  # every rank is done with the previous phase's files
            if rank == 0:
                for path in phase.get("remove", []):
                    shutil.rmtree(path)  # strict: removing what is not there is the test's mistake
            dist.barrier()
            run(dict(cfg, restore_only=True, tag=phase["tag"]), out, log)
    else:
        run(cfg, out, log)
    dist.barrier()
    dist.destroy_process_group()


def run(cfg: dict[str, Any], out: Path, log: Callable[..., None]) -> None:
    """Build the model, restore (and train unless ``restore_only``), rank 0 dumps OUT/<tag>.pt."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    width = cfg.get("width", 16)  # benchmarks/bench_node_restore.py makes it large
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randn(SAMPLES, 8, generator=torch.Generator().manual_seed(1))
    sampler = safepoint.ResumableSampler(SAMPLES, seed=7)
    loader = DataLoader(list(range(SAMPLES)), batch_size=2, sampler=sampler, generator=torch.Generator())
    state = safepoint.TrainState(model=model, optimizer=opt, dataloader=sampler)
    local = os.environ["NODE_LOCAL_ROOT"]
    cluster = safepoint.ClusterOptions(collective_timeout_s=60)
    tag = cfg.get("tag", "final")
    with safepoint.CheckpointManager(
        cfg["durable"],
        local_root=local,
        save_every_steps=cfg.get("save_every", 1000),
        cluster=cluster,
        storage_options=cfg.get("storage_options"),
    ) as mgr:
        t0 = time.perf_counter()
        step = mgr.restore(state)
        took = time.perf_counter() - t0
        files = dict(mgr.last_restore.files) if mgr.last_restore is not None else {}
        log("restored", step=step, files=files, seconds=took, tag=tag)
        if not cfg.get("restore_only"):
            step = train(cfg, out, mgr, model, opt, data, sampler, loader, state, step, log)
        mgr.wait()
    sd = {
        "model": get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)),
        "optim": get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True)),
        "sampler": sampler.state_dict(),
    }
    if rank == 0:
        torch.save(sd, out / f"{tag}.pt")
    log("finished", step=step, tag=tag)


def train(cfg, out, mgr, model, opt, data, sampler, loader, state, step, log):  # type: ignore[no-untyped-def]
    world = dist.get_world_size()
    while step < cfg["end"]:
        for batch in loader:
            loss = model(data[batch]).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            log("step", step=step, epoch=sampler.epoch, samples=batch.tolist())
            mgr.maybe_save(step, state)
            full = cfg.get("full", 2)  # the world size with both nodes
            if world == full and step == cfg.get("block_at") and not (out / "blocked").exists():
                mgr.wait()
                pids = [None] * world
                dist.all_gather_object(pids, os.getpid())
                if dist.get_rank() == 0:
                    (out / "blocked").write_text(json.dumps(pids))
                # Nobody sends: this waits until the test kills the other node, whose sockets then close.
                dist.recv(torch.zeros(1), src=(dist.get_rank() + world // 2) % world)  # the other node
                raise SystemExit("the peer node was expected to die")
            if world == full // 2 and step == cfg.get("pause_at"):
                mgr.wait()
                (out / "paused").write_text(str(os.getpid()))
                while True:  # the agent stops this worker (SIGTERM) when the node rejoins
                    time.sleep(0.1)
            if step >= cfg["end"]:
                break
        else:
            sampler.set_epoch(sampler.epoch + 1)
    return step


if __name__ == "__main__":
    run_then_exit(main)  # never through the teardown: tests/helpers/procs/exiting.py
