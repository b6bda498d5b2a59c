"""Collectives per save and per restore: safepoint against plain DCP, counted in a real torchrun job.

    torchrun --standalone --nproc-per-node=N benchmarks/collectives.py OUT.json [ROOT] [--fsdp2] [--rounds R]

Every public collective of ``torch.distributed`` (the object ones DCP and safepoint call, and the tensor
ones) is wrapped with a counter; nested calls (``broadcast_object_list`` runs two ``broadcast``s inside
c10d) are not counted twice, because c10d calls its own module's functions, not the wrapped attributes.
Counted around the second ``mgr.save`` (steady state: the first one also agrees on a session id), around
``mgr.restore``, around ``dcp.save`` and ``dcp.load`` of the same state on the same group. Rank 0 writes
{"world": N, "safepoint_save": {...}, "dcp_save": {...}, "safepoint_restore": {...}, "dcp_load": {...}},
each {collective name: calls}. Used by tests/dist/test_collectives.py (a regression fails) and for the table
in benchmarks/README.md (the summary in docs/benchmarks.md).

``--fsdp2``: the state is a small MLP sharded with FSDP2 (``fully_shard`` on a CPU mesh) and AdamW, with
per-rank RNG and ``extra``. ``--rounds R``: also times R saves of each (safepoint, plain DCP), interleaved
and in alternating order, each after a barrier, on rank 0 (``save_s``: {"safepoint": [...], "dcp": [...]});
and records the ``.metadata`` sizes: plain DCP's, safepoint's, and safepoint's with the per-rank sections
inside it (the format before rank files), and the rank files' total.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import shutil
import sys
import tempfile
import time
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


def _state(fsdp2: bool) -> tuple[safepoint.TrainState, dict[str, Any]]:
    torch.manual_seed(0)
    if not fsdp2:
        model: torch.nn.Module = torch.nn.Linear(64, 64)
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(2, 64)).sum().backward()
        opt.step()
        return safepoint.TrainState(model=model, optimizer=opt), {"model": model.state_dict()}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    width = 512  # 3 layers: 0.79M parameters, 9.5 MB with AdamW's two moments
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(3)))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    state = safepoint.TrainState(model=model, optimizer=opt, rng=True, extra={"seen": 1})
    return state, {"model": model.state_dict(), "optim": opt.state_dict()}


def _timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("root", type=Path, nargs="?")
    ap.add_argument("--fsdp2", action="store_true")
    ap.add_argument("--rounds", type=int, default=0)
    args = ap.parse_args()
    out = args.out
    base = args.root or Path(tempfile.mkdtemp(prefix="collectives-"))
    safepoint.init_process_group("gloo")
    rank = dist.get_rank()
    for name in NAMES:
        setattr(dist, name, _counting(name, getattr(dist, name)))
    state, sd = _state(args.fsdp2)
    result: dict[str, Any] = {"world": dist.get_world_size()}
    with safepoint.CheckpointManager(base / "safepoint", keep=safepoint.Keep(last=2)) as mgr:
        mgr.save(1, state)
        result["safepoint_save"] = count(lambda: mgr.save(2, state))
        result["safepoint_restore"] = count(lambda: mgr.restore(state))
        group = mgr.comm.group  # plain DCP on the same kind of group
        target = str(base / "dcp")
        result["dcp_save"] = count(lambda: dcp.save(sd, checkpoint_id=target, process_group=group))
        result["dcp_load"] = count(lambda: dcp.load(sd, checkpoint_id=target, process_group=group))
        if args.rounds:
            result.update(_rounds(mgr, state, sd, base, args.rounds))
    if rank == 0:
        out.write_text(json.dumps(result))
    dist.destroy_process_group()


def _rounds(
    mgr: safepoint.CheckpointManager, state: safepoint.TrainState, sd: dict[str, Any], base: Path, n: int
) -> dict[str, Any]:
    """Save times (rank 0, seconds) and .metadata sizes; see the module docstring."""
    import safepoint.store.rank_state as rank_state

    group, times = mgr.comm.group, {"safepoint": [], "dcp": []}  # type: dict[str, list[float]]
    for i in range(n):
        target = base / f"dcp-{i}"
        runs = [
            ("safepoint", functools.partial(mgr.save, 10 + i, state)),
            ("dcp", functools.partial(dcp.save, sd, checkpoint_id=str(target), process_group=group)),
        ]
        for name, fn in runs if i % 2 == 0 else runs[::-1]:
            times[name].append(_timed(fn))
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(target)
    step = Path(mgr.layout.step_path(10 + n - 1))
    sizes = {
        "dcp": (base / "dcp" / ".metadata").stat().st_size,
        "safepoint": (step / ".metadata").stat().st_size,
        "rank_files": sum(p.stat().st_size for p in step.glob("rank-*.state")),
    }
    real = rank_state.split_sections
    rank_state.split_sections = lambda d: (d, {})  # the format before rank files
    try:
        mgr.save(1000, state)
    finally:
        rank_state.split_sections = real
    sizes["safepoint_sections_inside"] = (Path(mgr.layout.step_path(1000)) / ".metadata").stat().st_size
    mgr.wait()
    return {"save_s": times, "metadata_bytes": sizes}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    # Without the interpreter's teardown, in which torch 2.13's gloo threads can abort the process
    # (docs/elastic.md, "Ending a gloo job").
    sys.stdout.flush()
    os._exit(0)
