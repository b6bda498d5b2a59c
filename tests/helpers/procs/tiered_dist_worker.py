"""torchrun worker: a 2-rank tiered save. Each rank talks to its own endpoint (rank 1 through the test's
proxy), so the test can see which rank uploaded which file. argv: local_root url endpoint0 endpoint1."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import safepoint
from tests.helpers.procs.exiting import run_then_exit


def main() -> None:
    local_root, url, endpoints = sys.argv[1], sys.argv[2], sys.argv[3:5]
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
    dist.destroy_process_group()


if __name__ == "__main__":
    run_then_exit(main)  # never through the teardown: tests/helpers/procs/exiting.py
