#!/usr/bin/env python
"""Issue 4 benchmark: how long an async save blocks, and what async saves cost a training loop.

Part 1, blocking time (same process, variants interleaved per round, ``--size-mib`` of fp32 parameters
plus Adam state, on disk and on /dev/shm):
  safepoint-async  CheckpointManager(root, async_save=True).save(step, TrainState(model, optimizer)): the
                   call's duration (capture + staging into reused buffers). The previous save is waited for
                   before the clock starts, so this is staging, never waiting.
  dcp-async        torch.distributed.checkpoint.async_save(get_state_dict(...), FileSystemWriter) with its
                   default stager (the writer's BlockingAsyncStager: fresh CPU copy per call) and the
                   THREAD executor (the only one that works without a process group): time until it returns.
  safepoint-sync   CheckpointManager(root).save(...): the whole save (write, crc32c, fsync, commit).
  copy             a bare ``dst.copy_(src)`` of every tensor into preallocated buffers: the staging limit.
Targets: safepoint-async <= 1.2x copy and <= 0.25x safepoint-sync (paired per round, median over rounds).
A breakdown of the safepoint staging (capture / buffer check / copy) is timed on the side, next to torch's
``_check_state_dict_similarity``, which copies every tensor as a side effect of its check.

Part 2, training throughput: an MLP (``--train-mib`` of parameters, plus Adam state) trained on fixed random
batches, a save every ``--every`` (K) steps. Measured in windows of one save interval: the save call, then K
steps. The save in flight is drained after the window, off the clock, so windows are independent and can be
interleaved finely (other jobs on a shared 2-core VM move throughput by several x within a minute); a
window whose write did not finish within its K steps is flagged "spilled". Variants, order rotated every
round, for each torch intra-op thread count in ``--train-threads``:
  none             no checkpoints (the baseline).
  safepoint-async  CheckpointManager(async_save=True).save (the thread writer).
  safepoint-sync   CheckpointManager(async_save=False).save.
  dcp-thread       dcp.async_save, default stager, AsyncCheckpointerType.THREAD.
  dcp-process      dcp.async_save, default stager, AsyncCheckpointerType.PROCESS: DCP's writer process. It
                   needs a process group once, to start its daemon: a single-rank gloo group on a loopback
                   TCPStore is created for the warm-up save and destroyed again, so every other variant runs
                   without a group, exactly as in Part 1.
Two steps/s ratios per variant, median over rounds: ``x none`` divides the round's no-checkpoint window by
this window (simple, but windows tens of seconds apart see different load); ``x self`` compares the window
with its own steps after the write finished (see ``self_paired``; the ``none`` row shows the estimator's
noise floor). Target: safepoint-async ``x self`` >= 0.97. ``contention`` is the extra time of the steps
that ran while the write did: what the background writer (thread or process) took from the training loop.
``save cost`` = (blocking + contention) / clean step time, in steps; the loop keeps K / (K + cost) of its
throughput at a save every K steps, so ``K for 0.97`` = cost x 0.97 / 0.03 is the shortest interval that
meets the target.

    .venv/bin/python benchmarks/bench_async.py --size-mib 2048 --rounds 5

Results: tables on stdout and ``<out>/bench_async.json`` with every raw timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import crc32c
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.distributed._state_dict_utils import _check_state_dict_similarity, _copy_state_dict
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import safepoint
from safepoint import staging

MiB = 1024 * 1024
# Run in this order each round: the two references for safepoint-async sit right next to it in time.
BLOCK_VARIANTS = ("copy", "safepoint-async", "safepoint-sync", "dcp-async")
TRAIN_VARIANTS = ("none", "safepoint-async", "safepoint-sync", "dcp-thread", "dcp-process")
COPY_TARGET = 1.2  # safepoint async blocking <= 1.2x the bare copy
SYNC_TARGET = 0.25  # ... and <= 0.25x the sync save
TRAIN_TARGET = 0.97  # steps/s with async saves >= 0.97x the loop without checkpoints


# ---- helpers --------------------------------------------------------------------------------------------


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def nbytes_of(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def paired(a: dict[int, float], b: dict[int, float], fn: Callable[[float, float], float]) -> float | None:
    """Median over rounds of fn(a[r], b[r]) for rounds both have."""
    vals = [fn(a[r], b[r]) for r in a if r in b]
    return statistics.median(vals) if vals else None


def fs_description(path: Path) -> dict[str, Any]:
    real = os.path.realpath(path)
    best = ("", "", "")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                best = (dev, mnt, fstype)
    except OSError:
        pass
    st = os.statvfs(path)
    return {
        "path": str(path),
        "device": best[0],
        "mount": best[1],
        "fstype": best[2],
        "free_gb": round(st.f_bavail * st.f_frsize / 1e9, 1),
    }


def machine_description(locations: dict[str, Path]) -> dict[str, Any]:
    cpu = ""
    mem_kb = 0
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    except OSError:
        pass
    try:
        load = list(os.getloadavg())
    except OSError:
        load = []
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "kernel": platform.release(),
        "cpu": cpu,
        "nproc": os.cpu_count(),
        "ram_gib": round(mem_kb / MiB, 1),
        "loadavg_at_start": load,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safepoint": safepoint.__version__,
        "crc32c_hardware_based": bool(crc32c.hardware_based),
        "torch_threads_default": torch.get_num_threads(),
        "locations": {name: fs_description(path) for name, path in locations.items()},
    }


# ---- part 1: blocking time ------------------------------------------------------------------------------


class BagModel(nn.Module):
    """fp32 parameters shaped like transformer blocks: (h, h) and (4h, h) matrices plus biases/norms."""

    def __init__(self, param_bytes: int, h: int = 1024) -> None:
        super().__init__()
        while h > 16 and 4 * (12 * h * h + 6 * h) > param_bytes:
            h //= 2  # tiny sizes (smoke runs): narrower blocks
        block = [(3 * h, h), (h, h), (4 * h, h), (4 * h,), (h, 4 * h), (h,), (h,)]
        block_bytes = 4 * sum(_numel(s) for s in block)
        n = max(1, param_bytes // block_bytes)
        for i in range(n):
            for j, shape in enumerate(block):
                self.register_parameter(f"b{i}_{j}", nn.Parameter(torch.empty(shape)))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def make_bag(size_bytes: int) -> tuple[BagModel, torch.optim.Adam]:
    """Parameters + Adam state (2 moments) adding up to about ``size_bytes``; one Adam step fills them."""
    torch.manual_seed(0)
    model = BagModel(size_bytes // 3)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


@dataclasses.dataclass
class BlockRun:
    location: str
    variant: str
    round: int
    blocking_s: float
    total_s: float | None  # until durable (async variants); None for copy
    recorded_s: float | None  # mgr.saves[-1].blocking_s for safepoint


class BlockLocation:
    """One place checkpoints go (disk or /dev/shm) and the managers writing there."""

    def __init__(self, name: str, base: Path, model: BagModel, opt: torch.optim.Adam) -> None:
        self.name = name
        self.base = base
        base.mkdir(parents=True, exist_ok=True)
        self.model = model
        self.opt = opt
        self.async_mgr = safepoint.CheckpointManager(base / "sp-async", async_save=True)
        self.sync_mgr = safepoint.CheckpointManager(base / "sp-sync")
        self.step = 0

    def state(self) -> safepoint.TrainState:
        return safepoint.TrainState(model=self.model, optimizer=self.opt)

    def run(self, variant: str, rnd: int, copy_fn: Callable[[], None]) -> BlockRun:
        self.step += 1
        step = self.step
        gc.collect()
        if variant == "safepoint-async":
            self.async_mgr.wait()  # the previous save is done: measure staging, never waiting
            state = self.state()
            t0 = time.perf_counter()
            self.async_mgr.save(step, state)
            blocking = time.perf_counter() - t0
            self.async_mgr.wait()
            total = time.perf_counter() - t0
            recorded = self.async_mgr.saves[-1].blocking_s
            self.async_mgr.layout.remove(step)
            return BlockRun(self.name, variant, rnd, blocking, total, recorded)
        if variant == "safepoint-sync":
            state = self.state()
            t0 = time.perf_counter()
            self.sync_mgr.save(step, state)
            blocking = time.perf_counter() - t0
            self.sync_mgr.layout.remove(step)
            return BlockRun(self.name, variant, rnd, blocking, blocking, blocking)
        if variant == "dcp-async":
            out = self.base / f"dcp-{step}"
            t0 = time.perf_counter()
            model_sd, optim_sd = get_state_dict(self.model, [self.opt])
            fut = dcp.async_save(
                {"model": model_sd, "optimizer": optim_sd},
                storage_writer=FileSystemWriter(out, single_file_per_rank=True, sync_files=True),
                async_checkpointer_type=AsyncCheckpointerType.THREAD,
                no_dist=True,
            )
            blocking = time.perf_counter() - t0
            _result(fut)
            total = time.perf_counter() - t0
            shutil.rmtree(out)
            return BlockRun(self.name, variant, rnd, blocking, total, None)
        if variant == "copy":
            t0 = time.perf_counter()
            copy_fn()
            return BlockRun(self.name, variant, rnd, time.perf_counter() - t0, None, None)
        raise ValueError(f"unknown variant {variant!r}")

    def close(self) -> None:
        self.async_mgr.close()
        self.sync_mgr.close()
        shutil.rmtree(self.base, ignore_errors=True)


def _result(fut: Any) -> Any:
    """dcp.async_save returns a Future, or an AsyncSaveResponse with an upload_completion future."""
    if isinstance(fut, Future):
        return fut.result()
    return fut.upload_completion.result()


def staging_breakdown(loc: BlockLocation) -> dict[str, float]:
    """Where safepoint's staging time goes, on the async manager's own (idle, already allocated) buffers."""
    loc.async_mgr.wait()
    stager = loc.async_mgr._stager
    buffers = stager._buffers
    assert buffers is not None, "stage once before the breakdown"
    state = loc.state()
    t0 = time.perf_counter()
    sd = state.capture(0)
    t1 = time.perf_counter()
    ok = staging._similar(sd, buffers)
    t2 = time.perf_counter()
    _copy_state_dict(sd, buffers, non_blocking=True, type_check=False)
    t3 = time.perf_counter()
    # The same bytes into the same buffers with a bare loop, right after: DCP's traversal overhead.
    for src, dst in zip(_tensors(sd), _tensors(buffers), strict=True):
        dst.copy_(src)
    t4 = time.perf_counter()
    # What the check cost before safepoint had its own: torch's walk copies every tensor into the companion.
    torch_ok = _check_state_dict_similarity(sd, buffers)
    t5 = time.perf_counter()
    assert ok and torch_ok
    return {
        "capture_s": t1 - t0,
        "check_s": t2 - t1,
        "copy_s": t3 - t2,
        "bare_copy_s": t4 - t3,
        "torch_check_s": t5 - t4,
    }


def run_blocking(args: argparse.Namespace, paths: dict[str, Path], console: Console) -> dict[str, Any]:
    console.print(f"[bold]part 1, blocking[/]: building ~{args.size_mib} MiB (params + Adam state) ...")
    model, opt = make_bag(args.size_mib * MiB)
    model_sd, optim_sd = get_state_dict(model, [opt])
    src = _tensors({"model": model_sd, "optimizer": optim_sd})
    nbytes = sum(t.numel() * t.element_size() for t in src)
    bufs = [torch.empty_like(t) for t in src]

    def bare_copy() -> None:
        for s, d in zip(src, bufs, strict=True):
            d.copy_(s)

    console.print(f"  {len(src)} tensors, {nbytes / MiB:.0f} MiB, torch threads {torch.get_num_threads()}")
    locations = {name: BlockLocation(name, p / "blocking", model, opt) for name, p in paths.items()}
    variants = [v for v in BLOCK_VARIANTS if v in args.block_variants]
    runs: list[BlockRun] = []
    breakdown: list[dict[str, float]] = []
    try:
        for rnd in range(-args.warmup, args.rounds):
            for loc in locations.values():
                for variant in variants:
                    r = loc.run(variant, rnd, bare_copy)
                    if rnd >= 0:
                        runs.append(r)
                    total = "" if r.total_s is None else f"  (done after {r.total_s:6.3f}s)"
                    console.print(
                        f"  [dim]{'warmup' if rnd < 0 else f'round {rnd}':>8} {loc.name:<5} {variant:<16}"
                        f" blocks {r.blocking_s:7.3f}s{total}[/]"
                    )
            first = next(iter(locations.values()))
            if rnd >= 0 and "safepoint-async" in variants:
                b = staging_breakdown(first)
                breakdown.append(b)
                console.print(
                    "  [dim]   stage breakdown " + "  ".join(f"{k} {v:.3f}" for k, v in b.items()) + "[/]"
                )
        allocations = {name: loc.async_mgr._stager.allocations for name, loc in locations.items()}
    finally:
        for loc in locations.values():
            loc.close()
    return {
        "bytes": nbytes,
        "runs": [dataclasses.asdict(r) for r in runs],
        "summary": summarize_blocking(runs, nbytes),
        "breakdown": breakdown,
        "breakdown_median": {
            k: median([b[k] for b in breakdown]) for k in (breakdown[0] if breakdown else {})
        },
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
            row: dict[str, Any] = {
                "location": location,
                "variant": variant,
                "n": len(t),
                "median_s": median(list(t.values())),
                "min_s": min(t.values()),
                "max_s": max(t.values()),
                "gb_s": nbytes / median(list(t.values())) / 1e9,
                "total_median_s": median(totals.get(variant, [])) if variant in totals else None,
                "x_copy": vs_copy,
                "x_sync": vs_sync,
                "met": None,
            }
            if variant == "safepoint-async" and vs_copy is not None and vs_sync is not None:
                row["met"] = {"copy": vs_copy <= COPY_TARGET, "sync": vs_sync <= SYNC_TARGET}
            rows.append(row)
    return rows


# ---- part 2: training throughput ------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, param_bytes: int, width: int) -> None:
        super().__init__()
        layers = max(1, param_bytes // (4 * width * (width + 1)))
        self.net = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


@dataclasses.dataclass
class Window:
    threads: int
    variant: str
    round: int
    steps: int
    seconds: float  # the save's blocking time + ``steps`` training steps
    blocking_s: float | None  # None for "none"
    spilled: bool  # the background write was still running when the window ended
    drain_s: float  # how long it still ran after that (outside the timed window)
    step_s: list[float]  # every step's duration
    busy: list[bool]  # whether the background write was still running when that step ended


class Trainer:
    """One model + Adam trained on fixed random batches; every window continues the same run."""

    def __init__(self, args: argparse.Namespace, base: Path) -> None:
        torch.manual_seed(0)
        self.model = MLP(args.train_mib * MiB, args.width)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(args.batch, args.width)
        self.y = torch.randn(args.batch, args.width)
        self.base = base
        self.every = args.every
        base.mkdir(parents=True, exist_ok=True)
        self.sp_async = safepoint.CheckpointManager(base / "sp-async", async_save=True, keep_last=1)
        self.sp_sync = safepoint.CheckpointManager(base / "sp-sync", keep_last=1)
        self.step_no = 0
        self.dcp_n = 0
        self.step()  # Adam state exists from here on
        self.state_bytes = nbytes_of(get_state_dict(self.model, [self.opt]))

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        self.step_no += 1

    def state(self) -> safepoint.TrainState:
        return safepoint.TrainState(model=self.model, optimizer=self.opt)

    def dcp_save(self, kind: AsyncCheckpointerType) -> Future[Any]:
        self.dcp_n += 1
        out = self.base / f"dcp-{self.dcp_n}"
        model_sd, optim_sd = get_state_dict(self.model, [self.opt])
        fut = dcp.async_save(
            {"model": model_sd, "optimizer": optim_sd},
            storage_writer=FileSystemWriter(out, single_file_per_rank=True, sync_files=True),
            async_checkpointer_type=kind,
            no_dist=True,
        )
        return fut if isinstance(fut, Future) else fut.upload_completion

    def window(self, variant: str, threads: int, rnd: int) -> Window:
        """One save interval as the training loop sees it: the save call, then ``every`` steps.

        The save in flight is drained (and its files deleted) after the window, outside the clock, so the
        next window starts clean; ``spilled`` says the write did not fit in the interval.
        """
        torch.set_num_threads(threads)
        gc.collect()
        kinds = {"dcp-thread": AsyncCheckpointerType.THREAD, "dcp-process": AsyncCheckpointerType.PROCESS}
        pending: Future[Any] | None = None
        blocking: float | None = None
        t0 = time.perf_counter()
        if variant == "safepoint-async":
            self.sp_async.save(self.step_no, self.state())
            blocking = time.perf_counter() - t0
        elif variant == "safepoint-sync":
            self.sp_sync.save(self.step_no, self.state())
            blocking = time.perf_counter() - t0
        elif variant in kinds:
            pending = self.dcp_save(kinds[variant])
            blocking = time.perf_counter() - t0
        elif variant != "none":
            raise ValueError(f"unknown variant {variant!r}")
        step_s: list[float] = []
        busy: list[bool] = []
        ts = time.perf_counter()
        for _ in range(self.every):
            self.step()
            now = time.perf_counter()
            step_s.append(now - ts)
            busy.append(self.sp_async._writer.busy or (pending is not None and not pending.done()))
            ts = now
        seconds = time.perf_counter() - t0
        spilled = busy[-1]
        t1 = time.perf_counter()
        self.sp_async.wait()
        if pending is not None:
            pending.result()
            shutil.rmtree(self.base / f"dcp-{self.dcp_n}", ignore_errors=True)
        drain = time.perf_counter() - t1
        return Window(threads, variant, rnd, self.every, seconds, blocking, spilled, drain, step_s, busy)

    def close(self) -> None:
        self.sp_async.close()
        self.sp_sync.close()
        shutil.rmtree(self.base, ignore_errors=True)


def start_dcp_process_writer(trainer: Trainer, log_path: Path, console: Console) -> float:
    """Start DCP's checkpoint daemon: it needs a process group once (then saves pass no_dist=True).

    A single-rank gloo group on a loopback TCPStore; destroyed right after, so nothing else sees a group.
    The daemon logs every request at INFO on its stderr; it inherits ours, pointed at ``log_path`` here.
    """
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # the daemon's own store binds here
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    sys.stderr.flush()
    saved_stderr = os.dup(2)
    t0 = time.perf_counter()
    try:
        with open(log_path, "ab") as log:
            os.dup2(log.fileno(), 2)
            trainer.dcp_save(AsyncCheckpointerType.PROCESS).result()
    finally:
        os.dup2(saved_stderr, 2)
        os.close(saved_stderr)
        dist.destroy_process_group()
        shutil.rmtree(trainer.base / f"dcp-{trainer.dcp_n}", ignore_errors=True)
    took = time.perf_counter() - t0
    console.print(
        f"  DCP writer process started (first save incl. spawn + gloo init: {took:.1f}s; its log: {log_path})"
    )
    return took


def run_train(args: argparse.Namespace, base: Path, console: Console) -> dict[str, Any]:
    torch.set_num_threads(max(args.train_threads))
    trainer = Trainer(args, base / "train")
    variants = [v for v in TRAIN_VARIANTS if v in args.train_variants]
    console.print(
        f"[bold]part 2, training[/]: MLP {trainer.state_bytes / MiB:.0f} MiB params+Adam, "
        f"batch {args.batch}, windows of one save + {args.every} steps; threads {args.train_threads}; "
        f"{', '.join(variants)}; {args.train_rounds} rounds (+{args.train_warmup} warm-up), order rotated"
    )
    runs: list[Window] = []
    spawn_s = None
    try:
        if "dcp-process" in variants:
            spawn_s = start_dcp_process_writer(trainer, Path(args.out) / "dcp_process.log", console)
        for rnd in range(-args.train_warmup, args.train_rounds):
            for threads in args.train_threads:
                # Rotate the order every round: no variant always follows the same one.
                shift = rnd % len(variants)
                for variant in variants[shift:] + variants[:shift]:
                    w = trainer.window(variant, threads, rnd)
                    if rnd >= 0:
                        runs.append(w)
                    blk = "" if w.blocking_s is None else f" save blocked {w.blocking_s:6.3f}s"
                    spill = f" [yellow]write spilled {w.drain_s:.2f}s past the window[/]" if w.spilled else ""
                    console.print(
                        f"  [dim]{'warmup' if rnd < 0 else f'round {rnd}':>8} threads {threads} {variant:<16}"
                        f" {w.steps / w.seconds:6.2f} steps/s{blk}{spill}[/]"
                    )
    finally:
        trainer.close()
    return {
        "state_bytes": trainer.state_bytes,
        "every": args.every,
        "batch": args.batch,
        "width": args.width,
        "dcp_process_first_save_s": spawn_s,
        "runs": [dataclasses.asdict(r) for r in runs],
        "summary": summarize_train(runs),
    }


MIN_CLEAN_STEPS = 3


def self_paired(w: Window, fallback_step_s: float | None) -> dict[str, float] | None:
    """The window against itself: its steps after the write finished are its own no-checkpoint baseline.

    Adjacent steps share the machine's load far better than windows a minute apart. ``x_self`` is
    K * t_clean / (blocking + sum of step times), t_clean the median clean step; ``contention_s`` the
    extra time of the steps that ran during the write. Steps of the window without a save give the
    estimator's own noise floor (its x_self is a little under 1 when step times are skewed).
    """
    clean = [t for t, b in zip(w.step_s, w.busy, strict=True) if not b]
    if len(clean) >= MIN_CLEAN_STEPS:
        t_clean = statistics.median(clean)
    elif fallback_step_s is not None:
        t_clean = fallback_step_s
    else:
        return None
    blocking = w.blocking_s or 0.0
    during = [t for t, b in zip(w.step_s, w.busy, strict=True) if b]
    contention = sum(during) - len(during) * t_clean
    return {
        "x_self": w.steps * t_clean / (blocking + sum(w.step_s)),
        "contention_s": contention,
        "write_steps": float(len(during)),
        # What one save costs the loop, in steps; the ratio at interval K is K / (K + cost).
        "cost_steps": (blocking + contention) / t_clean,
    }


def summarize_train(runs: list[Window]) -> list[dict[str, Any]]:
    rows = []
    for threads in dict.fromkeys(r.threads for r in runs):
        by: dict[str, dict[int, Window]] = {}
        for r in runs:
            if r.threads == threads:
                by.setdefault(r.variant, {})[r.round] = r
        base = {k: r.seconds for k, r in by.get("none", {}).items()}
        base_step = {k: statistics.median(r.step_s) for k, r in by.get("none", {}).items()}
        for variant in [v for v in TRAIN_VARIANTS if v in by]:
            ws = by[variant]
            secs = {k: w.seconds for k, w in ws.items()}
            ratio = paired(secs, base, lambda a, b: b / a)  # steps/s ratio = t_none / t_variant
            selfs = [x for k, w in ws.items() if (x := self_paired(w, base_step.get(k))) is not None]
            x_self = median([x["x_self"] for x in selfs]) if selfs else None
            blocking = [w.blocking_s for w in ws.values() if w.blocking_s is not None]
            steps = next(iter(ws.values())).steps
            cost = median([x["cost_steps"] for x in selfs]) if selfs and variant != "none" else None
            rows.append(
                {
                    "threads": threads,
                    "variant": variant,
                    "n": len(ws),
                    "steps_s": median([steps / s for s in secs.values()]),
                    "x_none": ratio,
                    "x_none_min": min((base[k] / s for k, s in secs.items() if k in base), default=None),
                    "x_none_max": max((base[k] / s for k, s in secs.items() if k in base), default=None),
                    "x_self": x_self,
                    "x_self_min": min((x["x_self"] for x in selfs), default=None),
                    "x_self_max": max((x["x_self"] for x in selfs), default=None),
                    "blocking_median_s": median(blocking) if blocking else None,
                    "contention_per_save_s": median([x["contention_s"] for x in selfs])
                    if selfs and variant != "none"
                    else None,
                    "write_steps_median": median([x["write_steps"] for x in selfs]) if selfs else None,
                    "cost_steps": cost,
                    # The smallest save interval (in steps) that keeps TRAIN_TARGET: K / (K + cost) >= target.
                    "k_for_target": cost * TRAIN_TARGET / (1 - TRAIN_TARGET) if cost is not None else None,
                    "spilled": sum(w.spilled for w in ws.values()),
                    "met": x_self >= TRAIN_TARGET
                    if variant == "safepoint-async" and x_self is not None
                    else None,
                }
            )
    return rows


# ---- output ---------------------------------------------------------------------------------------------


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "" if x is None else format(x, fmt)


def _spread(mid: float | None, lo: float | None, hi: float | None) -> str:
    if mid is None:
        return ""
    return f"{mid:.3f} [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None else f"{mid:.3f}"


def print_tables(console: Console, result: dict[str, Any]) -> None:
    meta = result["meta"]
    console.print(
        f"\n[bold]machine[/]: {meta['nproc']} cpus ({meta['cpu']}), {meta['ram_gib']} GiB RAM, torch "
        f"{meta['torch']}, load at start {meta['loadavg_at_start']}"
    )
    blk = result.get("blocking")
    if blk:
        table = Table(
            title=f"blocking time, {blk['bytes'] / MiB:.0f} MiB state (x = paired per-round ratio, median)"
        )
        for col in (
            "where",
            "variant",
            "median s",
            "min s",
            "max s",
            "GB/s",
            "x copy",
            "x sync",
            "done after s",
        ):
            table.add_column(col, justify="left" if col in ("where", "variant") else "right")
        table.add_column("target")
        last = None
        for r in blk["summary"]:
            if last is not None and r["location"] != last:
                table.add_section()
            last = r["location"]
            verdict = ""
            if r["met"] is not None:
                verdict = (
                    f"x copy <= {COPY_TARGET} {'[green]met[/]' if r['met']['copy'] else '[red]missed[/]'}, "
                    f"x sync <= {SYNC_TARGET} {'[green]met[/]' if r['met']['sync'] else '[red]missed[/]'}"
                )
            table.add_row(
                r["location"],
                r["variant"],
                _f(r["median_s"]),
                _f(r["min_s"]),
                _f(r["max_s"]),
                _f(r["gb_s"], ".2f"),
                _f(r["x_copy"]),
                _f(r["x_sync"]),
                _f(r["total_median_s"]),
                verdict,
            )
        console.print(table)
        if blk["breakdown_median"]:
            bt = Table(title="safepoint staging breakdown (median s)")
            for col in (
                "capture",
                "buffer check",
                "copy",
                "bare copy, same buffers",
                "torch's check (copies)",
            ):
                bt.add_column(col, justify="right")
            b = blk["breakdown_median"]
            bt.add_row(
                _f(b["capture_s"]),
                _f(b["check_s"], ".4f"),
                _f(b["copy_s"]),
                _f(b["bare_copy_s"]),
                _f(b["torch_check_s"]),
            )
            console.print(bt)
    tr = result.get("train")
    if tr:
        table = Table(
            title=(
                f"training loop: MLP {tr['state_bytes'] / MiB:.0f} MiB params+Adam, windows of one save + "
                f"{tr['every']} steps; steps/s ratios: median [min, max] over rounds"
            )
        )
        cols = ("threads", "variant", "steps/s", "x self [min, max]", "x none", "blocking s", "contention s")
        for col in (*cols, "save cost (steps)", f"K for {TRAIN_TARGET}", "spilled"):
            table.add_column(col, justify="left" if col == "variant" else "right")
        table.add_column("target (x self)")
        last_t = None
        for r in tr["summary"]:
            if last_t is not None and r["threads"] != last_t:
                table.add_section()
            last_t = r["threads"]
            verdict = ""
            if r["met"] is not None:
                verdict = f">= {TRAIN_TARGET} " + ("[green]met[/]" if r["met"] else "[red]missed[/]")
            save = r["variant"] != "none"
            table.add_row(
                str(r["threads"]),
                r["variant"],
                _f(r["steps_s"], ".2f"),
                _spread(r["x_self"], r["x_self_min"], r["x_self_max"]),
                _f(r["x_none"]) if save else "",
                _f(r["blocking_median_s"]),
                _f(r["contention_per_save_s"]),
                _f(r["cost_steps"], ".2f"),
                _f(r["k_for_target"], ".0f"),
                f"{r['spilled']}/{r['n']}" if save else "",
                verdict,
            )
        console.print(table)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    def csv(s: str) -> list[str]:
        return [x for x in s.split(",") if x]

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", type=csv, default=["blocking", "train"], help="blocking,train (default both)")
    p.add_argument("--size-mib", type=int, default=2048, help="part 1 state size in MiB (default 2048)")
    p.add_argument("--rounds", type=int, default=5, help="part 1 interleaved rounds (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="part 1 untimed rounds first (default 1)")
    p.add_argument("--block-variants", type=csv, default=list(BLOCK_VARIANTS), help=",".join(BLOCK_VARIANTS))
    p.add_argument("--locations", type=csv, default=["disk", "shm"], help="disk,shm (default both)")
    p.add_argument("--disk-dir", default=None, help="scratch directory on disk (default <out>/scratch)")
    p.add_argument("--shm-dir", default="/dev/shm", help="scratch directory on tmpfs (default /dev/shm)")
    p.add_argument("--train-mib", type=int, default=128, help="part 2 MLP parameter MiB (x3 with Adam)")
    p.add_argument("--width", type=int, default=2048, help="part 2 MLP width (default 2048)")
    p.add_argument("--batch", type=int, default=32, help="part 2 batch size (default 32)")
    p.add_argument("--every", type=int, default=20, help="part 2: save every K steps (default 20)")
    p.add_argument("--train-rounds", type=int, default=8, help="part 2 interleaved rounds (default 8)")
    p.add_argument("--train-warmup", type=int, default=1, help="part 2 untimed rounds first (default 1)")
    p.add_argument(
        "--train-threads",
        type=lambda s: [int(x) for x in csv(s)],
        default=[2, 1],
        help="torch intra-op thread counts to try (default 2,1)",
    )
    p.add_argument("--train-variants", type=csv, default=list(TRAIN_VARIANTS), help=",".join(TRAIN_VARIANTS))
    p.add_argument("--train-location", default="disk", choices=("disk", "shm"), help="part 2 checkpoints")
    p.add_argument("--out", default="bench-out", help="results directory (default bench-out/)")
    args = p.parse_args(argv)
    for name, allowed in (
        ("parts", ("blocking", "train")),
        ("locations", ("disk", "shm")),
        ("block_variants", BLOCK_VARIANTS),
        ("train_variants", TRAIN_VARIANTS),
    ):
        for v in getattr(args, name):
            if v not in allowed:
                p.error(f"--{name.replace('_', '-')}: unknown value {v!r} (choose from {', '.join(allowed)})")
    if min(args.size_mib, args.rounds, args.train_mib, args.every, args.train_rounds) < 1:
        p.error("sizes, rounds, and --every must be >= 1")
    if args.warmup < 0 or args.train_warmup < 0 or not args.train_threads or min(args.train_threads) < 1:
        p.error("--warmup/--train-warmup must be >= 0 and --train-threads >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # kill <pid> still runs the finally blocks that delete the GBs this wrote.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    console = Console(width=None if sys.stdout.isatty() else 160)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = f"safepoint-bench-async-{os.getpid()}"
    paths: dict[str, Path] = {}
    if "disk" in args.locations or args.train_location == "disk":
        paths["disk"] = Path(args.disk_dir or out_dir / "scratch") / tag
    if "shm" in args.locations or args.train_location == "shm":
        paths["shm"] = Path(args.shm_dir) / tag
    for p in paths.values():
        p.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"meta": machine_description(paths)}
    # Imports leave ~10^6 objects behind: freeze them, so the gc.collect() before each timed call is quick.
    gc.collect()
    gc.freeze()
    result["config"] = {
        **vars(args),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "targets": {"x_copy": COPY_TARGET, "x_sync": SYNC_TARGET, "train_x_none": TRAIN_TARGET},
    }
    try:
        if "blocking" in args.parts:
            result["blocking"] = run_blocking(
                args, {k: v for k, v in paths.items() if k in args.locations}, console
            )
        if "train" in args.parts:
            result["train"] = run_train(args, paths[args.train_location], console)
    finally:
        for p in paths.values():
            shutil.rmtree(p, ignore_errors=True)
    out = out_dir / "bench_async.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print_tables(console, result)
    console.print(f"raw results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
