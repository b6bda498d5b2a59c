"""What the torchrun plan workers share (tests/dist/worker.py, tests/dist_preempt/worker.py): the plan loop,
the per-rank JSON-lines log and seeding. Imported as ``tests.helpers.torchrun``: the launchers put the
repository root on PYTHONPATH (tests/helpers/launch.py).

A plan is ``{"out": DIR, "jobs": [JOB, ...]}``; jobs run in order, and one that finished in an earlier
torchrun attempt (``DIR/<name>.done``) is skipped, so a restart resumes the interrupted job and goes on.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist

import safepoint
from tests.helpers.procs.exiting import run_then_exit

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Log:
    """Appends one JSON record per event to ``DIR/log.rank<R>.jsonl`` (opened per record: a SIGKILL loses
    nothing already logged)."""

    def __init__(self, out: Path, rank: int) -> None:
        self.path = out / f"log.rank{rank}.jsonl"

    def __call__(self, job: str, event: str, **fields: Any) -> None:
        with open(self.path, "a") as f:
            record = {"job": job, "event": event, "attempt": ATTEMPT, "t": time.time(), **fields}
            f.write(json.dumps(record) + "\n")


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_plan(run_job: Callable[[dict[str, Any], Path, Log], None], audit: Callable[..., None]) -> NoReturn:
    """A worker's main(): run the plan in ``sys.argv[1]``, each job by ``run_job``, then exit at once.

    ``audit`` is the worker's CPython audit hook (its fault injection), installed before anything opens a
    checkpoint file."""
    plan = json.loads(Path(sys.argv[1]).read_text())
    out = Path(plan["out"])
    sys.addaudithook(audit)
    # Keys the store by torchrun attempt: without it restarted workers can read the dead attempt's gloo
    # addresses and hang or fail to connect (see safepoint.init_process_group).
    safepoint.init_process_group("gloo", timeout_s=60)
    rank = dist.get_rank()
    log = Log(out, rank)
    log("-", "start", world_size=dist.get_world_size())

    def jobs() -> None:
        for job in plan["jobs"]:
            done = out / f"{job['name']}.done"
            if done.exists():  # rank 0 wrote it after a barrier: every rank sees the same
                continue
            run_job(job, out, log)
            dist.barrier()
            if rank == 0:
                done.touch()
            dist.barrier()
        dist.destroy_process_group()

    # Never through the interpreter's teardown, where torch's gloo threads can abort the process (and which
    # costs over a second per launch): tests/helpers/procs/exiting.py.
    run_then_exit(jobs)
