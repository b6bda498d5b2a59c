"""How long an async ``save()`` blocks the loop, against a plain copy of the same bytes (issue 27), on CPU.

The per-save, per-tensor Python work of an async save (capture, the structure check, staging) is the
same on CPU as on a GPU, so this measures it where no GPU is needed. The state is parameters + Adam's two
moments (``benchmarks/bench_gpu.py``'s ``make_state``); before every save each tensor (parameters and
moments) is changed in place, as a training step changes them, so every tensor must be staged. Variants,
interleaved and rotated each round:

- ``foreach-copy``: ``torch._foreach_copy_`` of the same tensors into buffers allocated once;
- ``loop-copy``: the same with one ``copy_`` per tensor. The faster of the two is the **floor**;
- ``sp-async-thread`` / ``sp-async-process``: ``CheckpointManager(async_save=True)`` with that writer;
  blocked = the time ``save()`` took (each save starts with the previous one done: ``wait()`` first).

Reported per case: the median blocked time of each variant and its ratio to the floor (the median of
the per-round ratios to that round's floor), the load average at the start and the end; and, steadier on a
loaded machine than wall time, per variant the median CPU time of the calling thread while blocked
(``cpu_ms``), the cyclic GC's share of the blocked time (``gc_ms``, collections on the calling thread), and
for the saves the rank's CPU time from ``save()`` until the save is durable (``rank_cpu_ms``: every thread
of the training process, so the background write and, with the process writer, the handoff to it; not the
writer process's own CPU). Run::

    PYTHONPATH=src python benchmarks/bench_staging.py --cases 256x300,64x3000 --rounds 7
    PYTHONPATH=src python benchmarks/bench_staging.py --cases 144x3000 --rounds 5   # 9,000 x 64x64 fp32
    PYTHONPATH=src python benchmarks/bench_staging.py --profile sp-async-thread --cases 64x3000

``--profile VARIANT`` prints a cProfile of that variant's ``save()`` calls (sorted by cumulative time).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import make_state, rotated, state_tensors

import safepoint

KEEP = safepoint.Keep(last=1)
VARIANTS = ("foreach-copy", "loop-copy", "sp-async-thread", "sp-async-process")


class Case:
    def __init__(self, base: Path, size_mib: int, n_param: int) -> None:
        self.model, self.opt = make_state(size_mib << 20, n_param, torch.device("cpu"))
        self.state = safepoint.TrainState(model=self.model, optimizer=self.opt, rng=False)
        self.src = state_tensors(self.model, self.opt)
        self.steps = [s["step"] for s in self.opt.state.values()]
        self.bufs = [torch.empty_like(t) for t in self.src]
        self.mgrs = {
            f"sp-async-{w}": safepoint.CheckpointManager(
                base / w, async_save=True, keep=KEEP, writer=safepoint.WriterOptions(async_writer=w)
            )
            for w in ("thread", "process")
        }
        process = self.mgrs["sp-async-process"]._process
        if process is not None:  # its saves, warm-up included, go to the process, not to the thread
            process.wait_ready()
        self.step = 0
        self.profiler: cProfile.Profile | None = None
        self.profiled = ""
        self.cpu = 0.0  # of the last run: the calling thread's CPU while blocked
        self.gc = 0.0  # the calling thread's time in cyclic collections while blocked
        self.rank_cpu: float | None = None  # this process's CPU from save() until durable
        self._gc_start: float | None = None
        self._gc_on = False
        gc.callbacks.append(self._gc_callback)

    def _gc_callback(self, phase: str, info: dict[str, Any]) -> None:
        if not self._gc_on or threading.current_thread() is not threading.main_thread():
            return
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self.gc += time.perf_counter() - self._gc_start
            self._gc_start = None

    def touch(self) -> None:
        """A training step's change: every tensor written in place (version counters move), Adam's step
        counts too."""
        with torch.no_grad():
            torch._foreach_add_(self.src, 1e-3)
            torch._foreach_add_(self.steps, 1.0)

    def run(self, variant: str) -> float:
        self.step += 1
        self.touch()
        self.gc, self.rank_cpu = 0.0, None
        if variant in ("foreach-copy", "loop-copy"):
            self._gc_on = True
            c0, t0 = time.thread_time(), time.perf_counter()
            if variant == "foreach-copy":
                torch._foreach_copy_(self.bufs, self.src)
            else:
                for s, d in zip(self.src, self.bufs, strict=True):
                    d.copy_(s)
            took, self.cpu = time.perf_counter() - t0, time.thread_time() - c0
            self._gc_on = False
            return took
        mgr = self.mgrs[variant]
        mgr.wait()
        prof = self.profiler if variant == self.profiled else None
        self._gc_on = True
        p0, c0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
        if prof is not None:
            prof.enable()
        mgr.save(self.step, self.state)
        if prof is not None:
            prof.disable()
        took, self.cpu = time.perf_counter() - t0, time.thread_time() - c0
        self._gc_on = False
        mgr.wait()
        self.rank_cpu = time.process_time() - p0
        return took

    def close(self) -> None:
        gc.callbacks.remove(self._gc_callback)
        for mgr in self.mgrs.values():
            mgr.close()


def bench(case: Case, rounds: int, variants: Sequence[str]) -> dict[str, Any]:
    for v in variants:  # warm-up: buffer allocation, the writer process, plan caches
        case.run(v)
        case.run(v)
    runs: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    gcs: dict[str, list[float]] = {v: [] for v in variants}
    rank: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds):
        for v in rotated(variants, r):
            runs[v].append(case.run(v))
            cpu[v].append(case.cpu)
            gcs[v].append(case.gc)
            if case.rank_cpu is not None:
                rank[v].append(case.rank_cpu)
    copies = [runs[v] for v in ("foreach-copy", "loop-copy") if v in runs]
    if not copies:
        raise SystemExit("--variants needs foreach-copy or loop-copy: the floor the saves are compared with")
    floors = [min(xs) for xs in zip(*copies, strict=True)]
    med = {v: statistics.median(xs) for v, xs in runs.items()}
    ratio = {v: statistics.median(x / f for x, f in zip(xs, floors, strict=True)) for v, xs in runs.items()}

    def ms(xs: dict[str, list[float]]) -> dict[str, float]:
        return {v: round(1e3 * statistics.median(x), 1) for v, x in xs.items() if x}

    return {
        "median_blocked_ms": {v: round(1e3 * s, 2) for v, s in med.items()},
        "x_floor": {v: round(x, 2) for v, x in ratio.items()},
        "floor_ms": round(1e3 * statistics.median(floors), 2),
        "cpu_ms": ms(cpu),
        "gc_ms": ms(gcs),
        "rank_cpu_ms": ms(rank),
        "runs_ms": {v: [round(1e3 * s, 2) for s in xs] for v, xs in runs.items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--cases",
        type=lambda s: [tuple(int(v) for v in c.split("x")) for c in s.split(",")],
        default=[(256, 300), (64, 3000)],
        help="MIBxPARAMS,...: state MiB (params + Adam) and parameter count (default 256x300,64x3000)",
    )
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument(
        "--variants",
        type=lambda s: s.split(","),
        default=list(VARIANTS),
        help="a subset of " + ",".join(VARIANTS),
    )
    p.add_argument("--profile", default="", help="cProfile this variant's save() calls")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    where = Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir())
    out: dict[str, Any] = {"safepoint": safepoint.__file__, "loadavg_start": os.getloadavg()[0], "cases": []}
    for size, n in args.cases:
        base = Path(tempfile.mkdtemp(prefix="sp-staging-", dir=where))
        case = Case(base, size, n)
        if args.profile:
            case.profiler, case.profiled = cProfile.Profile(), args.profile
        try:
            res = bench(case, args.rounds, args.variants)
        finally:
            case.close()
            shutil.rmtree(base, ignore_errors=True)
        res.update(size_mib=size, tensors=len(case.src), loadavg=os.getloadavg()[0])
        out["cases"].append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "runs_ms"}), flush=True)
        if case.profiler is not None:
            pstats.Stats(case.profiler).sort_stats("cumulative").print_stats(45)
    out["loadavg_end"] = os.getloadavg()[0]
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
