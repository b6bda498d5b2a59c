#!/usr/bin/env python
"""Issue 27: where a small state's steady sync save spends its CPU, per function, by thread CPU time.

The state of ``bench_small_state.py`` (a 3-layer MLP + AdamW, ~1.6 MB), saved ``--saves`` times after two
warm-up saves through ``CheckpointManager.save`` (keep last 1, on ``/dev/shm``). Each function in ``PHASES``
is wrapped to add the thread CPU time (``time.thread_time``) spent inside it, in whichever thread runs it
(the retention pass runs on its own thread), so no profiler slows everything else down. Figures are ms per
save, inclusive of what a function calls (nested entries are part of their callers' figures; a recursive
function counts each level). Functions absent from the code under test are listed as skipped, so the
same command profiles two branches:

    PYTHONPATH=src python benchmarks/profile_small_state.py --saves 200
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_small_state import make

import safepoint

PHASES = [
    ("safepoint.manager", "CheckpointManager._save_sync"),
    ("safepoint.state", "TrainState.capture"),
    ("safepoint.state", "get_state_dict"),
    ("safepoint.data.fqn_cache", "state_dicts"),
    ("safepoint.save.saver", "SyncSaver.write"),
    ("safepoint.save.saver", "dcp_save"),
    ("safepoint.save.saver", "save_one_process"),
    ("safepoint.save.saver", "SyncSaver._commit"),
    ("safepoint.store.posix_layout", "Layout.commit"),
    ("safepoint.store.rank_state", "write"),
    ("safepoint.store.storage", "SafepointWriter.write_data"),
    ("safepoint.store.storage", "SafepointWriter.finish"),
    ("safepoint.store.storage", "SafepointWriter._write_entries"),
    ("torch.distributed.checkpoint.filesystem", "FileSystemWriter.prepare_local_plan"),
    ("safepoint.store.storage", "SafepointWriter.prepare_local_plan"),
    ("safepoint.save.plan_reuse", "ReusingSavePlanner.set_up_planner"),
    ("safepoint.store.incremental", "Round.arrange"),
    ("safepoint.store.incremental", "fingerprints"),
    ("safepoint.store.incremental", "link_into"),
    ("safepoint.store.links", "Linker.link"),
    ("safepoint.store.byte_file", "link_previous"),
    ("safepoint.events", "Events.emit"),
    ("safepoint.policy.journal", "Journal.__call__"),
    ("safepoint.policy.retainer", "Retainer._process"),
    ("safepoint.policy.retainer", "Retainer._apart_from_newest"),
    ("safepoint.store.posix_layout", "Layout.committed_steps"),
    ("safepoint.store.posix_layout", "Layout.remove"),
    ("safepoint.store.posix_layout", "Layout.fence"),
]


def wrap(spent: dict[str, float], module: str, qualname: str) -> bool:
    try:
        owner: Any = importlib.import_module(module)
    except ModuleNotFoundError:
        return False
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    fn = getattr(owner, name, None)
    if fn is None:
        return False

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[qualname] += time.thread_time() - t0

    setattr(owner, name, timed)
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--saves", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(1)
    spent: dict[str, float] = collections.defaultdict(float)
    skipped = [q for m, q in PHASES if not wrap(spent, m, q)]
    base = Path(tempfile.mkdtemp(prefix="prof-small-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        model, opt, _ = make()
        state = safepoint.TrainState(model=model, optimizer=opt)
        with safepoint.CheckpointManager(base / "sync", keep=safepoint.Keep(last=1)) as mgr:
            mgr.save(1, state)
            mgr.save(2, state)
            mgr.wait()
            spent.clear()
            p0, t0 = time.process_time(), time.thread_time()
            for i in range(args.saves):
                mgr.save(3 + i, state)
            t1 = time.thread_time()
            mgr.wait()  # the last retention pass too
            p1 = time.process_time()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    n = args.saves
    print(f"saving thread {(t1 - t0) / n * 1e3:.2f} ms/save, process {(p1 - p0) / n * 1e3:.2f} ms/save")
    for name, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"{seconds / n * 1e3:7.3f} ms  {name}")
    if skipped:
        print("not in this code:", ", ".join(skipped))


if __name__ == "__main__":
    main()
