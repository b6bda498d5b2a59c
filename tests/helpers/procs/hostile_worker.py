"""torchrun worker for tests/dist/test_hostile_nodes.py: several two-node saves in one launch, each
phase with a fresh model and manager and local roots of its own, as a launch of
tests/helpers/procs/nodes_worker.py would run it (each rank is a fresh interpreter that costs seconds of CPU
before it does anything, so the phases share the ranks).

    torchrun ... hostile_worker.py PLAN.json        ($NODE_LOCAL_ROOT names the agent's node: "nodeA", ...)

PLAN: {"out", "phases": [{"out", "durable", "end", "save_every", "tag", "locals": {NODE: LOCAL_ROOT}}, ...]}.
Phase by phase, in order, between barriers: ``nodes_worker.run`` with ``local_root`` the node's LOCAL_ROOT;
rank 0 dumps the full state to the phase's OUT/<tag>.pt, and every event is a JSON line in its OUT/log.jsonl.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
from pathlib import Path

import torch.distributed as dist

import safepoint
from tests.helpers.procs import nodes_worker
from tests.helpers.procs.exiting import run_then_exit


def _log(out: Path, record: dict[str, object], event: str, **fields: object) -> None:
    record = {"event": event, **record, "host": socket.gethostname()}
    with open(out / "log.jsonl", "a") as f:
        f.write(json.dumps({**record, **fields}) + "\n")


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    node = os.environ["NODE_LOCAL_ROOT"]
    safepoint.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for phase in plan["phases"]:
        dist.barrier()  # every rank is done with the previous phase
        out, local = Path(phase["out"]), phase["locals"][node]
        os.environ["NODE_LOCAL_ROOT"] = local  # what nodes_worker.run reads

        log = functools.partial(_log, out, {"rank": rank, "world": world, "local": local})
        nodes_worker.run(phase, out, log)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_then_exit(main)  # never through the teardown: tests/helpers/procs/exiting.py
