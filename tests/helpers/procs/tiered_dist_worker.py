"""torchrun worker: a 2-rank tiered save. Each rank talks to its own endpoint (rank 1 through the test's
proxy), so the test can see which rank uploaded which file. Then the same job straight to the store, and
incremental saves straight to the store (``incremental``). argv: local_root url endpoint0 endpoint1 out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import safepoint
from tests.helpers.procs.exiting import run_then_exit
from tests.helpers.tcpproxy import tcp_proxy

FROZEN = 1024 * 1024  # rank r's frozen tensor: (r + 1) MiB
MOVING = 1000  # float32s of each rank that change every save
STEPS = range(1, 8)
CHANGED = 4  # the step at which rank 1's frozen tensor changes (then it is frozen again)


def incremental(url: str, endpoint: str, rank: int, out: Path) -> None:
    """Incremental saves straight to the bucket on 2 ranks, each with a frozen tensor of its own (its own
    key: each rank writes, and copies, its own stable group) and a tensor that changes every save. Each rank
    goes through a TCP proxy of its own (tests/helpers/tcpproxy.py), which counts the bytes it sends per
    save: ``out/sent.<rank>.json``. Rank 1's frozen tensor changes at step CHANGED. Each save's state is
    written to ``out/rank<r>-step<s>.pt`` for the test to compare a step downloaded alone with; the last
    is restored on both ranks by a new manager."""
    torch.manual_seed(100 + rank)
    model = torch.nn.Module()
    frozen = torch.nn.Parameter(torch.randn((rank + 1) * FROZEN // 4), requires_grad=False)
    moving = torch.nn.Parameter(torch.zeros(MOVING))
    model.register_parameter(f"frozen{rank}", frozen)
    model.register_parameter(f"moving{rank}", moving)
    state = safepoint.TrainState(model=model, rng=False)
    sent: dict[int, int] = {}
    with tcp_proxy(endpoint) as proxy:
        opts = {"client_kwargs": {"endpoint_url": proxy.endpoint}}
        with safepoint.CheckpointManager(url, storage_options=opts, keep=safepoint.Keep(last=10)) as mgr:
            for step in STEPS:
                with torch.no_grad():
                    moving.add_(1.0)
                    if step == CHANGED and rank == 1:
                        frozen.mul_(-1.0)
                proxy.reset_counts()
                mgr.save(step, state)
                sent[step] = proxy.up
                torch.save(
                    {k: v.clone() for k, v in model.state_dict().items()}, out / f"rank{rank}-step{step}.pt"
                )
    (out / f"sent.{rank}.json").write_text(json.dumps(sent))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        frozen.zero_()
        moving.zero_()
    with safepoint.CheckpointManager(
        url, storage_options={"client_kwargs": {"endpoint_url": endpoint}}
    ) as mgr:
        # strict=False: the checkpoint holds the other rank's keys too, which this rank's module lacks.
        assert mgr.restore(state, strict=False) == STEPS[-1]
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    print(f"RANK {rank} INCREMENTAL OK", flush=True)


def main() -> None:
    local_root, url, endpoints, out = sys.argv[1], sys.argv[2], sys.argv[3:5], Path(sys.argv[5])
    safepoint.init_process_group("gloo")
    rank = dist.get_rank()
    opts = {"client_kwargs": {"endpoint_url": endpoints[rank]}}
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    state = safepoint.TrainState(model=model, extra={"rank": rank})
    with safepoint.CheckpointManager(
        url, local_root=local_root, storage_options=opts, keep=safepoint.Keep(last=1)
    ) as mgr:
        for step in (1, 2):
            with torch.no_grad():
                model.weight.fill_(step)
            mgr.save(step, state)
        mgr.wait()
        lag = mgr.durability_lag()
        print(f"RANK {rank} DURABLE {lag.durable_step} PENDING {lag.uploads_pending}", flush=True)
    # The same job writing straight to the store (no local tier), then reading it back on both ranks.
    with safepoint.CheckpointManager(url + "-direct", storage_options=opts) as mgr:
        mgr.save(7, state)
        with torch.no_grad():
            model.weight.zero_()
        assert mgr.restore(state) == 7
        assert float(model.weight.detach()[0, 0]) == 2.0
        print(f"RANK {rank} DIRECT OK", flush=True)
    incremental(url + "-incremental", endpoints[0], rank, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_then_exit(main)  # never through the teardown: tests/helpers/procs/exiting.py
