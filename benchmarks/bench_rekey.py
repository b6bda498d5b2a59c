"""Async staging of a state whose dicts come in another key order at every save (issue 27), on CPU.

A state dict rebuilt each step in another order (the same keys) used to change the staging plan's
signature at every save, so every save allocated a new buffer set; ``Plan.rekeyed`` (save/stage_plan.py)
now pairs the same buffers by key. The state: N parameters, each with an Adam-like entry
``{"exp_avg", "exp_avg_sq", "step"}`` (3N + N tensors), every tensor changed in place before each save (a
training step). Variants, interleaved and rotated each round, each with a stager of its own:

- ``same-order``: the state as it is (the plan fits; the reference);
- ``reordered``: every dict's keys reversed before each save (the same tensors).

Reported: the median ``Stager.stage`` time of each (wall, and CPU time of the staging thread: steadier on a
loaded machine), the ratio reordered / same-order (median of the per-round
ratios), the allocations each stager made, the load average. Run::

    PYTHONPATH=src python benchmarks/bench_rekey.py --params 2250 --rounds 9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from safepoint.save.staging import Stager


def make_state(n: int, numel: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    params = {f"layers.{i}.weight": torch.randn(numel, generator=g) for i in range(n)}
    state = {k: {"exp_avg": torch.randn(numel, generator=g), "exp_avg_sq": torch.rand(numel, generator=g),
                 "step": torch.tensor(1.0)} for k in params}  # fmt: skip
    return {
        "model": params,
        "optim": {"state": state, "param_groups": [{"lr": 1e-3, "params": list(params)}]},
    }


def reversed_keys(sd: Any) -> Any:
    if isinstance(sd, dict):
        return {k: reversed_keys(sd[k]) for k in reversed(list(sd))}
    if isinstance(sd, list):
        return [reversed_keys(v) for v in sd]
    return sd


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=2250, help="parameters (4 tensors each)")
    p.add_argument("--numel", type=int, default=1024, help="float32 elements per parameter tensor")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    states = {v: make_state(args.params, args.numel) for v in ("same-order", "reordered")}
    stagers = {v: Stager() for v in states}
    live = {v: [t for t in _tensors(sd)] for v, sd in states.items()}
    runs: dict[str, list[float]] = {v: [] for v in states}
    cpus: dict[str, list[float]] = {v: [] for v in states}
    for r in range(args.rounds + 2):  # two warm-up rounds: the first staging allocates
        for v in list(states)[r % 2 :] + list(states)[: r % 2]:
            with torch.no_grad():
                torch._foreach_add_(live[v], 1e-3)
            if v == "reordered":
                states[v] = reversed_keys(states[v])
            t0, c0 = time.perf_counter(), time.thread_time()
            stagers[v].stage(states[v])
            took, cpu = time.perf_counter() - t0, time.thread_time() - c0
            if r >= 2:
                runs[v].append(took)
                cpus[v].append(cpu)
    ratio = statistics.median(a / b for a, b in zip(runs["reordered"], runs["same-order"], strict=True))
    print(json.dumps({
        "tensors": len(live["same-order"]),
        "median_stage_ms": {v: round(1e3 * statistics.median(xs), 2) for v, xs in runs.items()},
        "median_stage_cpu_ms": {v: round(1e3 * statistics.median(xs), 2) for v, xs in cpus.items()},
        "reordered_x_same_order": round(ratio, 2),
        "allocations": {v: s.allocations for v, s in stagers.items()},
        "loadavg": [load0, os.getloadavg()[0]],
    }))  # fmt: skip
    return 0


def _tensors(sd: Any) -> list[torch.Tensor]:
    if isinstance(sd, torch.Tensor):
        return [sd]
    if isinstance(sd, dict):
        return [t for v in sd.values() for t in _tensors(v)]
    if isinstance(sd, list):
        return [t for v in sd for t in _tensors(v)]
    return []


if __name__ == "__main__":
    raise SystemExit(main())
