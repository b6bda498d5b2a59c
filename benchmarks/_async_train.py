"""Part 2 of benchmarks/bench_async.py: what async saves every K steps cost a training loop.

An MLP trained on fixed random batches, measured in windows of one save interval (the save call, then K
steps); see bench_async.py's docstring for the variants and the estimators.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import os
import random
import shutil
import statistics
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import MiB, load_1m, median, nbytes_of, round_label
from rich.console import Console
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, async_save

import safepoint
from safepoint.save import background

TRAIN_VARIANTS = (
    "none",
    "safepoint-async",
    "safepoint-async-process",
    "safepoint-async-nice0",
    "safepoint-sync",
    "dcp-thread",
    "dcp-process",
)
TRAIN_TARGET = 0.97  # steps/s with async saves >= 0.97x the loop without checkpoints


def dcp_async_save(sd: dict[str, Any], out: Path, kind: AsyncCheckpointerType) -> Future[Any]:
    """dcp.async_save with its default stager; returns the future that completes when the write is done."""
    writer = FileSystemWriter(out, single_file_per_rank=True, sync_files=True)
    fut = async_save(sd, storage_writer=writer, async_checkpointer_type=kind, no_dist=True)
    return fut if isinstance(fut, Future) else fut.upload_completion


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
    loadavg_1m: float | None = None


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
        self.sp_async = safepoint.CheckpointManager(
            base / "sp-async",
            async_save=True,
            writer=safepoint.WriterOptions(async_writer="thread"),
            keep=safepoint.Keep(last=1),
        )
        self.sp_process = safepoint.CheckpointManager(
            base / "sp-async-process",
            async_save=True,
            writer=safepoint.WriterOptions(async_writer="process"),
            keep=safepoint.Keep(last=1),
        )
        self.sp_sync = safepoint.CheckpointManager(base / "sp-sync", keep=safepoint.Keep(last=1))
        self.step_no = 0
        self.dcp_n = 0
        self.step()  # Adam state exists from here on
        self.state_bytes = nbytes_of(get_state_dict(self.model, [self.opt]))

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()  # type: ignore[no-untyped-call]
        self.opt.step()
        self.step_no += 1

    def state(self) -> safepoint.TrainState:
        return safepoint.TrainState(model=self.model, optimizer=self.opt)

    def dcp_save(self, kind: AsyncCheckpointerType) -> Future[Any]:
        self.dcp_n += 1
        model_sd, optim_sd = get_state_dict(self.model, [self.opt])
        out = self.base / f"dcp-{self.dcp_n}"
        return dcp_async_save({"model": model_sd, "optimizer": optim_sd}, out, kind)

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
        # The nice0 variant: the writer thread keeps the training thread's priority (the threads it starts
        # read WRITER_NICE when they start, inside the window).
        background.WRITER_NICE = 0 if variant == "safepoint-async-nice0" else 10
        t0 = time.perf_counter()
        if variant == "safepoint-async-process":
            self.sp_process.save(self.step_no, self.state())
            blocking = time.perf_counter() - t0
        elif variant.startswith("safepoint-async"):
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
            writing = self.sp_async._writer.busy or self.sp_process._writer.busy
            busy.append(writing or (pending is not None and not pending.done()))
            ts = now
        seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.sp_async.wait()
        self.sp_process.wait()
        if pending is not None:
            pending.result()
            shutil.rmtree(self.base / f"dcp-{self.dcp_n}", ignore_errors=True)
        drain = time.perf_counter() - t1
        background.WRITER_NICE = 10
        return Window(threads, variant, rnd, self.every, seconds, blocking, busy[-1], drain, step_s, busy)

    def close(self) -> None:
        self.sp_async.close()
        self.sp_process.close()
        self.sp_sync.close()
        shutil.rmtree(self.base, ignore_errors=True)


def start_dcp_process_writer(trainer: Trainer, log_path: Path, console: Console) -> float:
    """Start DCP's checkpoint daemon: it needs a process group once (then saves pass no_dist=True).

    A single-rank gloo group on a loopback TCPStore; destroyed right after, so nothing else sees a group.
    The daemon logs every request at INFO on its stderr; it inherits ours, pointed at ``log_path`` here.
    """
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # the daemon's own store binds here
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60)
    )
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
        f"  DCP writer process started (first save incl. spawn + gloo init: {took:.1f}s; log {log_path})"
    )
    return took


def run_train(args: argparse.Namespace, base: Path, console: Console) -> dict[str, Any]:
    torch.set_num_threads(max(args.train_threads))
    trainer = Trainer(args, base / "train")
    variants = [v for v in TRAIN_VARIANTS if v in args.train_variants]
    console.print(
        f"[bold]part 2, training[/]: MLP {trainer.state_bytes / MiB:.0f} MiB params+Adam, "
        f"batch {args.batch}, windows of one save + {args.every} steps; threads {args.train_threads}; "
        f"{', '.join(variants)}; {args.train_rounds} rounds (+{args.train_warmup} warm-up), order shuffled"
    )
    runs: list[Window] = []
    spawn_s = None
    try:
        if "dcp-process" in variants:
            spawn_s = start_dcp_process_writer(trainer, Path(args.out) / "dcp_process.log", console)
        for rnd in range(-args.train_warmup, args.train_rounds):
            for threads in args.train_threads:
                for variant in shuffled(variants, rnd):
                    w = trainer.window(variant, threads, rnd)
                    w.loadavg_1m = load_1m()
                    if rnd >= 0:
                        runs.append(w)
                    blk = "" if w.blocking_s is None else f" save blocked {w.blocking_s:6.3f}s"
                    spill = f" [yellow]write spilled {w.drain_s:.2f}s past the window[/]" if w.spilled else ""
                    console.print(
                        f"  [dim]{round_label(rnd):>8} threads {threads} {variant:<21}"
                        f" {w.steps / w.seconds:6.2f} steps/s{blk}{spill}  load {w.loadavg_1m}[/]"
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


def shuffled(variants: list[str], rnd: int) -> list[str]:
    """A different (seeded) order every round. Rotating is not enough here: it keeps every variant behind
    the same neighbour, and DCP's writer process goes on using the CPU for a while after its save reports
    done, which always landed on the window after it."""
    return random.Random(rnd).sample(variants, len(variants)) if rnd >= 0 else list(variants)


def self_paired(w: Window, fallback_step_s: float | None) -> dict[str, float] | None:
    """The window against itself: its steps after the write finished are its own no-checkpoint baseline.

    Adjacent steps share the machine's load far better than windows a minute apart. ``x_self`` is
    K * t_clean / (blocking + sum of step times), t_clean the mean clean step (the mean, not the median:
    on a shared machine step times are skewed, and a median made even the no-checkpoint window score
    0.77); ``contention_s`` the extra time of the steps that ran during the write. For the window without
    a save every step is clean, so its x_self is 1 by construction; the spread of the save windows is the
    noise to read the target against.
    """
    clean = [t for t, b in zip(w.step_s, w.busy, strict=True) if not b]
    if len(clean) >= MIN_CLEAN_STEPS:
        t_clean = statistics.fmean(clean)
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
        base_step = {k: statistics.fmean(r.step_s) for k, r in by.get("none", {}).items()}
        for variant in [v for v in TRAIN_VARIANTS if v in by]:
            ws = by[variant]
            secs = {k: w.seconds for k, w in ws.items()}
            x_none = [base[k] / s for k, s in secs.items() if k in base]  # steps/s ratio = t_none / t_variant
            selfs = [x for k, w in ws.items() if (x := self_paired(w, base_step.get(k))) is not None]
            x_self = median(x["x_self"] for x in selfs) if selfs else None
            blocking = [w.blocking_s for w in ws.values() if w.blocking_s is not None]
            saves = variant != "none"
            cost = median(x["cost_steps"] for x in selfs) if selfs and saves else None
            rows.append(
                {
                    "threads": threads,
                    "variant": variant,
                    "n": len(ws),
                    "steps_s": median(w.steps / w.seconds for w in ws.values()),
                    "x_none": median(x_none) if x_none else None,
                    "x_none_min": min(x_none, default=None),
                    "x_none_max": max(x_none, default=None),
                    "x_self": x_self,
                    "x_self_min": min((x["x_self"] for x in selfs), default=None),
                    "x_self_max": max((x["x_self"] for x in selfs), default=None),
                    "blocking_median_s": median(blocking) if blocking else None,
                    "contention_per_save_s": median(x["contention_s"] for x in selfs)
                    if selfs and saves
                    else None,
                    "write_steps_median": median(x["write_steps"] for x in selfs) if selfs else None,
                    "cost_steps": cost,
                    # The smallest save interval (in steps) that keeps TRAIN_TARGET: K / (K + cost) >= target.
                    "k_for_target": cost * TRAIN_TARGET / (1 - TRAIN_TARGET) if cost is not None else None,
                    "spilled": sum(w.spilled for w in ws.values()),
                    "met": x_self >= TRAIN_TARGET
                    if variant in ("safepoint-async", "safepoint-async-process") and x_self is not None
                    else None,
                }
            )
    return rows
