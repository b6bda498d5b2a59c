#!/usr/bin/env python
"""Where an async save's blocking time goes, process writer against thread writer (issue 27, GPU path).

On an H100 the process writer blocked 1.6-2x the thread writer at 9,000 tensors (docs/benchmarks.md "The
GPU path"), the extra being CPU time of the calling thread outside staging's copy. This profiles the
blocking call (``save()`` of a steady async save, the previous save waited for) under cProfile for each
writer and prints the functions by own time, so the two can be compared line by line; CUDA when there is a
device, else CPU. What changes before each save: ``--scenario`` (``bench_gpu.changer``), by default the
parameters and Adam's moments but not its 0-d step counts, so the per-tensor incremental check runs.

    python benchmarks/profile_gpu_save.py --size-mib 512 --params 3000 --saves 4
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import tempfile
import time
from pathlib import Path

import torch
from bench_gpu import SCENARIOS, changer, make_state, sync

import safepoint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--params", type=int, default=3000)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--writers", default="process,thread")
    p.add_argument("--scenario", choices=SCENARIOS, default="frozen-steps", help="bench_gpu.changer")
    a = p.parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model, opt = make_state(a.size_mib << 20, a.params, device)
    change = changer(model, opt, a.scenario)
    state = safepoint.TrainState(model=model, optimizer=opt, rng=False)
    base = Path(tempfile.mkdtemp(prefix="sp-prof-", dir="/dev/shm"))
    try:
        for writer in a.writers.split(","):
            opts = safepoint.WriterOptions(async_writer=writer)
            mgr = safepoint.CheckpointManager(
                base / writer, async_save=True, keep=safepoint.Keep(last=2), writer=opts
            )
            if mgr._process is not None:
                mgr._process.wait_ready()
            prof = cProfile.Profile()
            walls, cpus = [], []
            for step in range(1, a.saves + 4):
                change()
                sync()
                mgr.wait()
                measured = step > 3
                c0, t0 = time.thread_time(), time.perf_counter()
                if measured:
                    prof.enable()
                mgr.save(step, state)
                if measured:
                    prof.disable()
                    walls.append(time.perf_counter() - t0)
                    cpus.append(time.thread_time() - c0)
            mgr.wait()
            mgr.close()
            print(
                f"=== {writer}: blocked (profiled) {[round(w * 1e3) for w in walls]} ms, "
                f"thread CPU {[round(c * 1e3) for c in cpus]} ms, device {device}",
                flush=True,
            )
            st = pstats.Stats(prof)
            st.sort_stats("tottime").print_stats(a.top)
            st.sort_stats("cumulative").print_stats(a.top)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
