"""Where an async ``save()``'s blocking time goes, part by part, in CPU time of the calling thread (issue 27).

The per-tensor Python work of an async save's blocking path (capture, the one-walk staging, the version
counters and fingerprints, the batched copy) is the same code on CPU as on a GPU, so it is measured here on
CPU with the bytes shrunk: the state of ``bench_gpu.py`` (a ``ParameterList`` + Adam: 3 tensors and one 0-d
``step`` per parameter), by default 3,000 parameters in 8 MiB, so that the copy is cheap and what is left
is per-tensor overhead. Each measured save is timed with ``time.thread_time`` (the calling thread's CPU:
steadier than wall time on a loaded machine) and ``perf_counter``, and split by wrapping the functions of
the path, each adding its own ``thread_time``:

- ``capture``: ``TrainState.capture``, of which ``state_dicts`` (``fqn_cache.state_dicts``: the model's
  and optimizer's ``state_dict()`` and the FQN cache's identity check) and ``restorable``;
- ``walk``: ``stage_plan.walk`` (the snapshot and the signature), ``fits``: the plan's check of it;
- ``versions``: ``Stager._copy`` less the fingerprints and the copy (the version counters, the decision);
- ``fingerprints``, ``copy`` (``_copy_all`` and ``_copy_opaque``);
- ``other``: the rest of ``save()`` (the writer's room, the gate, submit, the events);
- ``gc``: the cyclic collections on the calling thread inside ``save()`` (counted inside the part they
  interrupted as well: mostly ``other``, the first allocations after the save's GC pause ends), and
  ``gcN_count``: how many collections of generation N.

The floor is ``torch._foreach_copy_`` of the same tensors (the 9,000 parameters and moments, as
``bench_gpu.py``'s) into buffers allocated once, in the same round. Writers and the floor are interleaved,
the order rotated each round; medians over the rounds. Run::

    PYTHONPATH=src python benchmarks/bench_blocking_parts.py --params 3000 --size-mib 8 --rounds 9
    PYTHONPATH=src python benchmarks/bench_blocking_parts.py --scenario frozen-steps --profile thread

``--profile WRITER`` prints a cProfile (own time) of that writer's saves after the table.
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
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import SCENARIOS, changer, make_state, rotated, state_tensors

import safepoint
from safepoint import state as state_mod
from safepoint.data import fqn_cache
from safepoint.save import stage_plan, staging

SPENT: dict[str, float] = defaultdict(float)
_GC: list[float] = []  # thread_time at the start of the collection in progress (on the main thread)


def _gc_callback(phase: str, info: dict[str, Any]) -> None:
    """The cyclic collections' CPU on the calling thread, counted as the part ``gc``."""
    if threading.current_thread() is not threading.main_thread():
        return
    if phase == "start":
        _GC.append(time.thread_time())
    elif _GC:
        SPENT["gc"] += time.thread_time() - _GC.pop()
        SPENT[f"gc{info['generation']}"] += 1


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        c0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[name] += time.thread_time() - c0

    return wrapper


def instrument() -> None:
    """Wrap each part of the blocking path where its caller looks it up."""
    state_mod.TrainState.capture = _timed("capture", state_mod.TrainState.capture)  # type: ignore[method-assign]
    fqn_cache.state_dicts = _timed("state_dicts", fqn_cache.state_dicts)
    state_mod.restorable = _timed("restorable", state_mod.restorable)
    staging.walk = _timed("walk", staging.walk)  # type: ignore[assignment]
    stage_plan.Plan.fits = _timed("fits", stage_plan.Plan.fits)  # type: ignore[method-assign]
    staging.Stager._copy = _timed("copy_path", staging.Stager._copy)  # type: ignore[method-assign]
    staging.fingerprints = _timed("fingerprints", staging.fingerprints)
    staging._copy_all = _timed("copy", staging._copy_all)
    staging._copy_opaque = _timed("copy_opaque", staging._copy_opaque)


def parts(spent: dict[str, float], total: float) -> dict[str, float]:
    """The breakdown of one save, in ms: the wrapped parts, nested ones taken out of their caller."""
    g = spent.get
    copy = g("copy", 0.0) + g("copy_opaque", 0.0)
    out = {
        "state_dicts": g("state_dicts", 0.0),
        "restorable": g("restorable", 0.0),
        "capture_rest": g("capture", 0.0) - g("state_dicts", 0.0) - g("restorable", 0.0),
        "walk": g("walk", 0.0),
        "fits": g("fits", 0.0),
        "versions": g("copy_path", 0.0) - g("fingerprints", 0.0) - copy,
        "fingerprints": g("fingerprints", 0.0),
        "copy": copy,
    }
    out["gc"] = g("gc", 0.0)  # inside whichever part it interrupted: not in the sum
    out["other"] = total - sum(v for k, v in out.items() if k != "gc")
    return {k: 1e3 * v for k, v in out.items()} | {f"gc{n}_count": g(f"gc{n}", 0.0) for n in range(3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=3000)
    p.add_argument("--size-mib", type=int, default=8, help="params + Adam moments, in MiB")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--writers", default="thread,process")
    p.add_argument("--scenario", choices=SCENARIOS, default="step", help="bench_gpu.changer")
    p.add_argument("--profile", default="", help="cProfile this writer's measured saves")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    instrument()
    gc.callbacks.append(_gc_callback)
    model, opt = make_state(a.size_mib << 20, a.params, torch.device("cpu"))
    change = changer(model, opt, a.scenario)
    state = safepoint.TrainState(model=model, optimizer=opt, rng=False)
    src = state_tensors(model, opt)
    bufs = [torch.empty_like(t) for t in src]
    base = Path(tempfile.mkdtemp(prefix="sp-parts-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    writers = a.writers.split(",")
    mgrs = {
        w: safepoint.CheckpointManager(
            base / w,
            async_save=True,
            keep=safepoint.Keep(last=1),
            writer=safepoint.WriterOptions(async_writer=w),
        )
        for w in writers
    }
    for m in mgrs.values():
        if m._process is not None:
            m._process.wait_ready()
    prof = cProfile.Profile() if a.profile else None
    variants = ["floor", *writers]
    rec: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    load0 = os.getloadavg()[0]
    step = 0
    try:
        for r in range(-2, a.rounds):  # two warm-up rounds: buffers, plan caches, the FQN cache
            for v in rotated(variants, r % len(variants)):
                change()
                if v == "floor":
                    c0, t0 = time.thread_time(), time.perf_counter()
                    torch._foreach_copy_(bufs, src)
                    row = {"wall": 1e3 * (time.perf_counter() - t0), "cpu": 1e3 * (time.thread_time() - c0)}
                else:
                    step += 1
                    mgr = mgrs[v]
                    mgr.wait()
                    SPENT.clear()
                    on = prof is not None and v == a.profile and r >= 0
                    c0, t0 = time.thread_time(), time.perf_counter()
                    if on:
                        prof.enable()  # type: ignore[union-attr]
                    mgr.save(step, state)
                    if on:
                        prof.disable()  # type: ignore[union-attr]
                    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
                    row = {"wall": 1e3 * wall, "cpu": 1e3 * cpu, **parts(dict(SPENT), cpu)}
                if r >= 0:
                    rec[v].append(row)
        for m in mgrs.values():
            m.wait()
    finally:
        for m in mgrs.values():
            m.close()
        shutil.rmtree(base, ignore_errors=True)
    med = {
        v: {k: round(statistics.median(x[k] for x in rows), 2) for k in rows[0]} for v, rows in rec.items()
    }
    floor = [x["cpu"] for x in rec["floor"]]
    for w in writers:
        med[w]["x_floor_cpu"] = round(
            statistics.median(x["cpu"] / f for x, f in zip(rec[w], floor, strict=True)), 2
        )
    out = {
        "safepoint": safepoint.__file__,
        "params": a.params,
        "size_mib": a.size_mib,
        "scenario": a.scenario,
        "tensors": len(src),
        "loadavg": [load0, os.getloadavg()[0]],
        "median_ms": med,
    }
    print(json.dumps(out, indent=1), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({**out, "rounds": rec}, indent=1))
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
