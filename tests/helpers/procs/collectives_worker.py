"""torchrun worker for tests/dist/test_collectives.py: the file's small two-rank scenarios, run one after the
other in one job (each rank is a fresh interpreter that costs seconds of CPU before it does anything, so the
scenarios share the ranks instead of each starting its own).

    torchrun --standalone --nproc-per-node=2 collectives_worker.py BASE OUT SCENARIO...

Each scenario works under BASE/SCENARIO and writes OUT/SCENARIO/rank{r} (its outcome on rank r); what a rank
writes to stderr during a scenario goes to OUT/SCENARIO/stderr-rank{r} (file descriptor 2 redirected, so
``warnings``, ``logging`` and anything below Python land there), for the test to read that scenario's own
messages. Every scenario ends with all ranks agreeing (a ``CheckpointError`` raised alike on every rank, or a
restore), so the group is whole for the next one; a rank stuck in a collective the other skipped would end
the job, which the test reports. Scenarios:

- ``counts``: the collectives around a steady-state ``mgr.save`` / ``mgr.restore`` and plain ``dcp.save`` /
  ``dcp.load`` of the same state, counted with benchmarks/collectives.py's counters; rank 0 writes the
  counts as JSON. Run first, as in a fresh process, so nothing an earlier scenario left can lower a count.
- ``manifest``: every rank now reads the manifest itself, so a manifest damaged for everyone must read as a
  corrupt checkpoint (fall back), never as "the root is not shared".
- ``data``: step 2's data file that only rank 1 verifies is damaged instead: corruption one rank found,
  never "ranks see different checkpoints".
- ``partial``: a partial restore (strict=False) where only rank 1 reads a damaged ``.metadata`` (node-local
  copies of one checkpoint, rank 1's altered after saving) must end the same way on every rank, as the
  default (strict) path does: never a rank stuck in a collective the other skipped.
- ``warm``: ``init_from`` a node-local path that exists for rank 0 only (each rank is given its own path to
  stand for one node-local path) must fail the same way on every rank, never leave rank 0 waiting in a
  collective that rank 1 skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from benchmarks import collectives as bench

import safepoint
from tests.helpers.procs.exiting import run_then_exit


def counts(base: Path) -> str:
    originals = {name: getattr(dist, name) for name in bench.NAMES}
    for name, fn in originals.items():
        setattr(dist, name, bench._counting(name, fn))
    try:
        state, sd = bench._state(False)
        result: dict[str, object] = {"world": dist.get_world_size()}
        with safepoint.CheckpointManager(base / "safepoint", keep=safepoint.Keep(last=2)) as mgr:
            mgr.save(1, state)
            result["safepoint_save"] = bench.count(lambda: mgr.save(2, state))
            result["safepoint_restore"] = bench.count(lambda: mgr.restore(state))
            group, target = mgr.comm.group, str(base / "dcp")  # plain DCP on the same kind of group
            result["dcp_save"] = bench.count(lambda: dcp.save(sd, checkpoint_id=target, process_group=group))
            result["dcp_load"] = bench.count(lambda: dcp.load(sd, checkpoint_id=target, process_group=group))
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return json.dumps(result)


def corrupt(base: Path, what: str) -> str:
    root = base / "ckpt"
    state = safepoint.TrainState(model=torch.nn.Linear(4, 4))
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        if dist.get_rank() == 0 and what == "manifest":
            (root / "step-2" / "safepoint.json").write_text("{not json")
        elif dist.get_rank() == 0:
            files = sorted(json.loads((root / "step-2" / "safepoint.json").read_text())["files"])
            path = root / "step-2" / files[1::2][0]  # the first file rank 1 verifies, rank 0 does not
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x01
            path.write_bytes(bytes(data))
        dist.barrier()
        return str(mgr.restore(state))


def partial(base: Path) -> str:
    rank = dist.get_rank()
    state = safepoint.TrainState(model=torch.nn.Linear(4, 4), rng=False)
    cluster = safepoint.ClusterOptions(collective_timeout_s=60)
    with safepoint.CheckpointManager(base / "shared", cluster=cluster) as mgr:
        mgr.save(1, state)
    if rank == 0:
        for r in (0, 1):
            shutil.copytree(base / "shared", base / f"r{r}", ignore=shutil.ignore_patterns(".lease"))
        metadata = base / "r1" / "step-1" / ".metadata"  # a file rank 1 does not verify up front
        data = bytearray(metadata.read_bytes())
        data[-3] ^= 0xFF
        metadata.write_bytes(bytes(data))
    dist.barrier()
    outcomes = []
    with safepoint.CheckpointManager(base / f"r{rank}", cluster=cluster) as mgr:
        for strict in (True, False):
            try:
                outcomes.append(f"restored {mgr.restore(state, strict=strict)}")
            except safepoint.CheckpointError as e:
                outcomes.append(f"{type(e).__name__}: {str(e).replace(str(base / f'r{rank}'), 'ROOT')}")
    return "\n".join(outcomes)


def warm(base: Path) -> str:
    rank = dist.get_rank()
    state = safepoint.TrainState(model=torch.nn.Linear(4, 4), rng=False)
    cluster = safepoint.ClusterOptions(collective_timeout_s=30)
    with safepoint.CheckpointManager(base / "pretrain", cluster=cluster) as mgr:
        mgr.save(3, state)
    source = base / ("pretrain" if rank == 0 else "missing")
    try:
        with safepoint.CheckpointManager(base / "run", cluster=cluster, init_from=source) as mgr:
            return f"restored {mgr.restore(state)}"
    except safepoint.CheckpointError as e:
        msg = str(e).replace(str(base / "pretrain"), "SOURCE").replace(str(base / "missing"), "SOURCE")
        return f"{type(e).__name__}: {msg}"


SCENARIOS: dict[str, Callable[[Path], str]] = {
    "counts": counts,
    "manifest": lambda base: corrupt(base, "manifest"),
    "data": lambda base: corrupt(base, "data"),
    "partial": partial,
    "warm": warm,
}


@contextlib.contextmanager
def stderr_to(path: Path) -> Iterator[None]:
    """File descriptor 2 to ``path`` while the block runs (Python's and native writes alike)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with path.open("wb") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def main() -> None:
    base, out = Path(sys.argv[1]), Path(sys.argv[2])
    safepoint.init_process_group("gloo")
    rank = dist.get_rank()
    for name in sys.argv[3:]:
        (base / name).mkdir(parents=True, exist_ok=True)
        (out / name).mkdir(parents=True, exist_ok=True)
        dist.barrier()  # every rank starts a scenario with the previous one over on all ranks
        with stderr_to(out / name / f"stderr-rank{rank}"):
            outcome = SCENARIOS[name](base / name)
        if name != "counts" or rank == 0:
            (out / name / f"rank{rank}").write_text(outcome)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_then_exit(main)  # never through the teardown: tests/helpers/procs/exiting.py
