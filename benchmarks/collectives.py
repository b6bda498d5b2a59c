"""Collectives per save and per restore: safepoint against plain DCP, counted in a real torchrun job.

    torchrun --standalone --nproc-per-node=N benchmarks/collectives.py OUT.json [ROOT]

Every public collective of ``torch.distributed`` (the object ones DCP and safepoint call, and the tensor
ones) is wrapped with a counter; nested calls (``broadcast_object_list`` runs two ``broadcast``s inside
c10d) are not counted twice, because c10d calls its own module's functions, not the wrapped attributes.
Counted around the second ``mgr.save`` (steady state: the first one also agrees on a session id), around
``mgr.restore``, around ``dcp.save`` and ``dcp.load`` of the same state on the same group. Rank 0 writes
{"world": N, "safepoint_save": {...}, "dcp_save": {...}, "safepoint_restore": {...}, "dcp_load": {...}},
each {collective name: calls}. Used by tests/dist/test_collectives.py (a regression fails) and for the table
in docs/benchmarks.md.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import safepoint

NAMES = (
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
    "all_reduce", "all_gather", "broadcast", "gather", "scatter", "reduce_scatter", "barrier",
    "all_to_all", "reduce",
)  # fmt: skip
COUNTS: collections.Counter[str] = collections.Counter()


def _counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        COUNTS[name] += 1
        return fn(*args, **kwargs)

    return wrapper


def count(fn: Callable[[], Any]) -> dict[str, int]:
    COUNTS.clear()
    fn()
    return dict(COUNTS)


def main() -> None:
    out = Path(sys.argv[1])
    base = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(tempfile.mkdtemp(prefix="collectives-"))
    safepoint.init_process_group("gloo")
    rank = dist.get_rank()
    for name in NAMES:
        setattr(dist, name, _counting(name, getattr(dist, name)))
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    state = safepoint.TrainState(model=model, optimizer=opt)
    result: dict[str, Any] = {"world": dist.get_world_size()}
    with safepoint.CheckpointManager(base / "safepoint") as mgr:
        mgr.save(1, state)
        result["safepoint_save"] = count(lambda: mgr.save(2, state))
        result["safepoint_restore"] = count(lambda: mgr.restore(state))
        group = mgr.comm.group  # plain DCP on the same kind of group
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        target = str(base / "dcp")
        result["dcp_save"] = count(lambda: dcp.save(sd, checkpoint_id=target, process_group=group))
        result["dcp_load"] = count(lambda: dcp.load(sd, checkpoint_id=target, process_group=group))
    if rank == 0:
        out.write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
