"""Part 1 of benchmarks/bench_async.py: how long an async save blocks the caller.

The same state (``--size-mib`` of parameters plus Adam state) staged or saved by each variant in turn, per
round, on disk and on /dev/shm; see bench_async.py's docstring for the variants and the targets.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _async_train import dcp_async_save
from _common import BenchState, MiB, load_1m, make_state, median, paired, round_label, tensors
from rich.console import Console
from torch.distributed._state_dict_utils import _check_state_dict_similarity
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import safepoint
from safepoint.save.stage_plan import walk

# Run in this order each round: the two references for safepoint-async sit right next to it in time.
BLOCK_VARIANTS = ("copy", "safepoint-async", "safepoint-async-process", "safepoint-sync", "dcp-async")
COPY_TARGET = 1.2  # safepoint async blocking <= 1.2x the bare copy
SYNC_TARGET = 0.25  # ... and <= 0.25x the sync save


# ---- part 1: blocking time ------------------------------------------------------------------------------


@dataclasses.dataclass
class BlockRun:
    location: str
    variant: str
    round: int
    blocking_s: float
    total_s: float | None  # until durable (async variants); None for copy
    recorded_s: float | None  # mgr.saves[-1].blocking_s for safepoint
    loadavg_1m: float | None = None


class BlockLocation:
    """One place checkpoints go (disk or /dev/shm) and the managers writing there."""

    def __init__(self, name: str, base: Path, state: BenchState) -> None:
        self.name = name
        self.base = base
        base.mkdir(parents=True, exist_ok=True)
        self.state = state
        self.async_mgr = safepoint.CheckpointManager(
            base / "sp-async", async_save=True, writer=safepoint.WriterOptions(async_writer="thread")
        )
        self.process_mgr = safepoint.CheckpointManager(
            base / "sp-async-process", async_save=True, writer=safepoint.WriterOptions(async_writer="process")
        )
        self.sync_mgr = safepoint.CheckpointManager(base / "sp-sync")
        self.step = 0

    def run(self, variant: str, rnd: int, copy_fn: Callable[[], None]) -> BlockRun:
        self.step += 1
        step = self.step
        gc.collect()
        state = self.state.train_state()
        t0 = time.perf_counter()
        if variant in ("safepoint-async", "safepoint-async-process"):
            mgr = self.async_mgr if variant == "safepoint-async" else self.process_mgr
            mgr.wait()  # the previous save is done: measure staging, never waiting
            t0 = time.perf_counter()
            mgr.save(step, state)
            blocking = time.perf_counter() - t0
            mgr.wait()
            total = time.perf_counter() - t0
            mgr.layout.remove(step)
            return BlockRun(self.name, variant, rnd, blocking, total, mgr.saves[-1].blocking_s)
        if variant == "safepoint-sync":
            self.sync_mgr.save(step, state)
            blocking = time.perf_counter() - t0
            self.sync_mgr.layout.remove(step)
            return BlockRun(self.name, variant, rnd, blocking, blocking, blocking)
        if variant == "dcp-async":
            out = self.base / f"dcp-{step}"
            model_sd, optim_sd = get_state_dict(self.state.model, [self.state.optimizer])
            sd = {"model": model_sd, "optimizer": optim_sd}
            fut = dcp_async_save(sd, out, AsyncCheckpointerType.THREAD)
            blocking = time.perf_counter() - t0
            fut.result()
            total = time.perf_counter() - t0
            shutil.rmtree(out)
            return BlockRun(self.name, variant, rnd, blocking, total, None)
        if variant == "copy":
            copy_fn()
            return BlockRun(self.name, variant, rnd, time.perf_counter() - t0, None, None)
        raise ValueError(f"unknown variant {variant!r}")

    def close(self) -> None:
        self.async_mgr.close()
        self.process_mgr.close()
        self.sync_mgr.close()
        shutil.rmtree(self.base, ignore_errors=True)


def staging_breakdown(loc: BlockLocation) -> dict[str, float]:
    """Where safepoint's staging time goes, on the async manager's own (idle, already allocated) buffers:
    capture, the walk that builds the snapshot and proves the buffers still fit (save/stage_plan.py), and
    the batched copy into them."""
    loc.async_mgr.wait()
    buffers = loc.async_mgr._stager._buffers
    plan = loc.async_mgr._stager._plan
    assert buffers is not None and plan is not None, "stage once before the breakdown"
    state = loc.state.train_state()
    t0 = time.perf_counter()
    sd = state.capture(0)
    t1 = time.perf_counter()
    walked = walk(sd, plan.slots)
    ok = plan.fits(walked) or plan.refit(walked)  # refit: the RNG state is a new tensor every capture
    t2 = time.perf_counter()
    with torch.no_grad():
        torch._foreach_copy_(plan.targets, plan.lives(walked), non_blocking=True)
    t3 = time.perf_counter()
    # The same bytes into the same buffers with a bare loop, right after: the batched copy's overhead.
    for src, dst in zip(tensors(sd), tensors(buffers), strict=True):
        dst.copy_(src)
    t4 = time.perf_counter()
    # What the check cost before safepoint had its own: torch's walk copies every tensor into the companion.
    torch_ok = _check_state_dict_similarity(sd, buffers)
    t5 = time.perf_counter()
    assert ok and torch_ok
    return {"capture_s": t1 - t0, "check_s": t2 - t1, "copy_s": t3 - t2, "bare_copy_s": t4 - t3,
            "torch_check_s": t5 - t4}  # fmt: skip


def run_blocking(args: argparse.Namespace, paths: dict[str, Path], console: Console) -> dict[str, Any]:
    console.print(f"[bold]part 1, blocking[/]: building ~{args.size_mib} MiB (params + Adam state) ...")
    state = make_state(args.size_mib * MiB)
    src = tensors(state.plain)
    bufs = [torch.empty_like(t) for t in src]

    def bare_copy() -> None:
        for s, d in zip(src, bufs, strict=True):
            d.copy_(s)

    console.print(
        f"  {len(src)} tensors, {state.nbytes / MiB:.0f} MiB, torch threads {torch.get_num_threads()}"
    )
    locations = {name: BlockLocation(name, p / "blocking", state) for name, p in paths.items()}
    variants = [v for v in BLOCK_VARIANTS if v in args.block_variants]
    runs: list[BlockRun] = []
    breakdown: list[dict[str, float]] = []
    try:
        for rnd in range(-args.warmup, args.rounds):
            for loc in locations.values():
                for variant in variants:
                    r = loc.run(variant, rnd, bare_copy)
                    r.loadavg_1m = load_1m()
                    if rnd >= 0:
                        runs.append(r)
                    total = "" if r.total_s is None else f"  (done after {r.total_s:6.3f}s)"
                    console.print(
                        f"  [dim]{round_label(rnd):>8} {loc.name:<5} {variant:<16} "
                        f"blocks {r.blocking_s:7.3f}s{total}  load {r.loadavg_1m}[/]"
                    )
            if rnd >= 0 and "safepoint-async" in variants:
                b = staging_breakdown(next(iter(locations.values())))
                breakdown.append(b)
                console.print(
                    "  [dim]   stage breakdown " + "  ".join(f"{k} {v:.3f}" for k, v in b.items()) + "[/]"
                )
        allocations = {name: loc.async_mgr._stager.allocations for name, loc in locations.items()}
    finally:
        for loc in locations.values():
            loc.close()
    return {
        "bytes": state.nbytes,
        "runs": [dataclasses.asdict(r) for r in runs],
        "summary": summarize_blocking(runs, state.nbytes),
        "breakdown": breakdown,
        "breakdown_median": {k: median(b[k] for b in breakdown) for k in (breakdown[0] if breakdown else {})},
        "staging_allocations": allocations,
    }


def summarize_blocking(runs: list[BlockRun], nbytes: int) -> list[dict[str, Any]]:
    rows = []
    for location in dict.fromkeys(r.location for r in runs):
        by: dict[str, dict[int, float]] = {}
        totals: dict[str, list[float]] = {}
        for r in runs:
            if r.location == location:
                by.setdefault(r.variant, {})[r.round] = r.blocking_s
                if r.total_s is not None:
                    totals.setdefault(r.variant, []).append(r.total_s)
        for variant in [v for v in BLOCK_VARIANTS if v in by]:
            t = by[variant]
            vs_copy = paired(t, by.get("copy", {}), lambda a, b: a / b)
            vs_sync = paired(t, by.get("safepoint-sync", {}), lambda a, b: a / b)
            met = None
            if variant.startswith("safepoint-async") and vs_copy is not None and vs_sync is not None:
                met = {"copy": vs_copy <= COPY_TARGET, "sync": vs_sync <= SYNC_TARGET}
            rows.append(
                {
                    "location": location,
                    "variant": variant,
                    "n": len(t),
                    "median_s": median(t.values()),
                    "min_s": min(t.values()),
                    "max_s": max(t.values()),
                    "gb_s": nbytes / median(t.values()) / 1e9,
                    "total_median_s": median(totals[variant]) if variant in totals else None,
                    "x_copy": vs_copy,
                    "x_sync": vs_sync,
                    "met": met,
                }
            )
    return rows
