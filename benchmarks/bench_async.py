#!/usr/bin/env python
"""Issue 4 benchmark: how long an async save blocks, and what async saves cost a training loop.

Part 1, blocking time (same process, variants interleaved per round, ``--size-mib`` of fp32 parameters
plus Adam state shaped like a small transformer, the state of benchmarks/bench_save.py, on disk and on
/dev/shm):
  safepoint-async  CheckpointManager(root, async_save=True, async_writer="thread").save(step,
                   TrainState(model, optimizer)): the call's duration (capture + staging into reused
                   buffers). The previous save is waited for before the clock starts: staging, never waiting.
  safepoint-async-process  the same with async_writer="process" (staging into a shared-memory segment).
  dcp-async        torch.distributed.checkpoint.async_save(get_state_dict(...), FileSystemWriter) with its
                   default stager (the writer's BlockingAsyncStager: fresh CPU copy per call) and the
                   THREAD executor (the only one that works without a process group): time until it returns.
  safepoint-sync   CheckpointManager(root).save(...): the whole save (write, crc32c, fsync, commit).
  copy             a bare ``dst.copy_(src)`` of every tensor into preallocated buffers: the staging limit.
Targets: safepoint-async <= 1.2x copy and <= 0.25x safepoint-sync (paired per round, median over rounds).
A breakdown of the safepoint staging (capture / walk and buffer check / batched copy) is timed on the side,
next to torch's ``_check_state_dict_similarity``, which copies every tensor as a side effect of its check.

Part 2, training throughput: an MLP (``--train-mib`` of parameters, plus Adam state) trained on fixed random
batches, a save every ``--every`` (K) steps. Measured in windows of one save interval: the save call, then K
steps. The save in flight is drained after the window, off the clock, so windows are independent and can be
interleaved finely (other jobs on a shared 2-core VM move throughput by several x within a minute); a
window whose write did not finish within its K steps is flagged "spilled". Variants, order rotated every
round, for each torch intra-op thread count in ``--train-threads``:
  none             no checkpoints (the baseline).
  safepoint-async  CheckpointManager(async_save=True, async_writer="thread").save (the thread writer, at
                   nice +10).
  safepoint-async-process  the same with async_writer="process": a writer process per rank (nice +10).
  safepoint-async-nice0  the same with the writer thread at the training thread's priority (WRITER_NICE=0):
                   what lowering the writer's priority buys.
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
meets the target. K defaults to 50: a save every ~10-25 s at this machine's step times, already far more
often than a real job saves (every 10-30 minutes, thousands of steps), yet long enough that the write
finishes inside the interval, which is what an async save needs.

    .venv/bin/python benchmarks/bench_async.py --size-mib 2048 --rounds 6

Results: tables on stdout, ``<out>/bench_async.json`` with every raw timing (and the 1-minute load average
after each), ``<out>/bench_async.md`` with the tables in Markdown.
Results: docs/benchmarks.md; runs and reading: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _async_blocking import BLOCK_VARIANTS, COPY_TARGET, SYNC_TARGET, run_blocking
from _async_train import TRAIN_TARGET, TRAIN_VARIANTS, run_train
from _common import (
    MiB,
    add_location_args,
    fmt,
    loadavg,
    machine_description,
    machine_line,
    markdown_table,
    print_table,
    scratch_paths,
)
from rich.console import Console

# ---- output ---------------------------------------------------------------------------------------------


def _verdict(ok: bool, rich: bool) -> str:
    if not rich:
        return "met" if ok else "missed"
    return "[green]met[/]" if ok else "[red]missed[/]"


def _tables(result: dict[str, Any], rich: bool) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, columns, rows) of every table of a result."""
    out: list[tuple[str, list[str], list[list[str]]]] = []
    blk = result.get("blocking")
    if blk:
        cols = ["where", "variant", "median s", "min s", "max s", "GB/s", "x copy", "x sync", "done after s"]
        rows = []
        for r in blk["summary"]:
            verdict = ""
            if r["met"] is not None:
                verdict = (
                    f"x copy <= {COPY_TARGET} {_verdict(r['met']['copy'], rich)}, "
                    f"x sync <= {SYNC_TARGET} {_verdict(r['met']['sync'], rich)}"
                )
            rows.append(
                [r["location"], r["variant"], fmt(r["median_s"]), fmt(r["min_s"]), fmt(r["max_s"]),
                 fmt(r["gb_s"], ".2f"), fmt(r["x_copy"]), fmt(r["x_sync"]), fmt(r["total_median_s"]), verdict]
            )  # fmt: skip
        title = f"blocking time, {blk['bytes'] / MiB:.0f} MiB state (x = paired per-round ratio, median)"
        out.append((title, [*cols, "target"], rows))
        if blk["breakdown_median"]:
            b = blk["breakdown_median"]
            cols = [
                "capture",
                "walk + buffer check",
                "batched copy",
                "bare copy, same buffers",
                "torch's check (copies)",
            ]
            keys = ("capture_s", "check_s", "copy_s", "bare_copy_s", "torch_check_s")
            out.append(("safepoint staging breakdown (median s)", cols, [[fmt(b[k], ".4f") for k in keys]]))
    tr = result.get("train")
    if tr:
        cols = ["threads", "variant", "steps/s", "x self [min, max]", "x none", "blocking s", "contention s"]
        cols += ["save cost (steps)", f"K for {TRAIN_TARGET}", "spilled", "target (x self)"]
        rows = []
        for r in tr["summary"]:
            save = r["variant"] != "none"
            spread = (
                ""
                if r["x_self"] is None
                else f"{r['x_self']:.3f} [{r['x_self_min']:.2f}, {r['x_self_max']:.2f}]"
            )
            verdict = "" if r["met"] is None else f">= {TRAIN_TARGET} {_verdict(r['met'], rich)}"
            rows.append(
                [str(r["threads"]), r["variant"], fmt(r["steps_s"], ".2f"), spread,
                 fmt(r["x_none"]) if save else "", fmt(r["blocking_median_s"]),
                 fmt(r["contention_per_save_s"]), fmt(r["cost_steps"], ".2f"), fmt(r["k_for_target"], ".0f"),
                 f"{r['spilled']}/{r['n']}" if save else "", verdict]
            )  # fmt: skip
        title = (
            f"training loop: MLP {tr['state_bytes'] / MiB:.0f} MiB params+Adam, windows of one save + "
            f"{tr['every']} steps; steps/s ratios: median [min, max] over rounds"
        )
        out.append((title, cols, rows))
    return out


def print_tables(console: Console, result: dict[str, Any]) -> None:
    console.print(machine_line(result["meta"]))
    for title, cols, rows in _tables(result, rich=True):
        print_table(console, title, cols, rows)


def markdown_tables(result: dict[str, Any]) -> str:
    return "\n".join(
        f"**{title}**\n\n{markdown_table(cols, rows)}\n" for title, cols, rows in _tables(result, False)
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    def csv(s: str) -> list[str]:
        return [x for x in s.split(",") if x]

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", type=csv, default=["blocking", "train"], help="blocking,train (default both)")
    p.add_argument("--size-mib", type=int, default=2048, help="part 1 state size in MiB (default 2048)")
    p.add_argument("--rounds", type=int, default=6, help="part 1 interleaved rounds (default 6)")
    p.add_argument("--warmup", type=int, default=1, help="part 1 untimed rounds first (default 1)")
    p.add_argument("--block-variants", type=csv, default=list(BLOCK_VARIANTS), help=",".join(BLOCK_VARIANTS))
    add_location_args(p)
    p.add_argument("--train-mib", type=int, default=128, help="part 2 MLP parameter MiB (x3 with Adam)")
    p.add_argument("--width", type=int, default=2048, help="part 2 MLP width (default 2048)")
    p.add_argument("--batch", type=int, default=32, help="part 2 batch size (default 32)")
    p.add_argument("--every", type=int, default=50, help="part 2: save every K steps (default 50)")
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
    p.add_argument("--render", metavar="JSON", help="print the tables of an earlier run's JSON; run nothing")
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
    console = Console(width=None if sys.stdout.isatty() else 160)
    if args.render:
        earlier = json.loads(Path(args.render).read_text())
        print_tables(console, earlier)
        print(markdown_tables(earlier))
        return 0
    # kill <pid> still runs the finally blocks that delete the GBs this wrote.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    wanted = [*(args.locations if "blocking" in args.parts else [])]
    wanted += [args.train_location] if "train" in args.parts else []
    paths = scratch_paths(args, "safepoint-bench-async", dict.fromkeys(wanted))
    result: dict[str, Any] = {"meta": machine_description(paths)}
    # Imports leave ~10^6 objects behind: freeze them, so the gc.collect() before each timed call is quick.
    gc.collect()
    gc.freeze()
    result["config"] = {
        **vars(args),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "targets": {"x_copy": COPY_TARGET, "x_sync": SYNC_TARGET, "train_x_self": TRAIN_TARGET},
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
    result["meta"]["loadavg_at_end"] = loadavg()
    out = Path(args.out) / "bench_async.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    (out.parent / "bench_async.md").write_text(markdown_tables(result))
    print_tables(console, result)
    console.print(f"raw results: {out} (Markdown tables: {out.parent / 'bench_async.md'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
