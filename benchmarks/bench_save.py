#!/usr/bin/env python
"""Issue 2 benchmark: safepoint's sync save and verified restore against plain DCP, torch.save and dd.

Every variant writes (or reads) the same tensors: the parameters of a transformer-shaped model plus its
Adam state (exp_avg, exp_avg_sq), ``--size-mib`` in all, fp32, tensors of a few different sizes.

Save variants (throughput; the target is safepoint >= 0.95x plain DCP):
  safepoint         CheckpointManager.save(step, TrainState(model, optimizer)): capture, write with crc32c,
                    manifest, commit (fsync files + dirs, rename). What a user sees.
  safepoint-writer  SyncSaver.write of the plain state dict: the same minus capture/RNG (crc32c + commit).
  dcp               torch.distributed.checkpoint.save with the same writer settings (FileSystemWriter,
                    single_file_per_rank, sync_files=True, same thread_count).
  torch.save        torch.save of the same dict to one file, then fsync.
  dd                dd if=/dev/zero bs=64M conv=fdatasync of the same number of bytes (the device's ceiling).

Restore variants (time; the target is safepoint <= 1.15x plain DCP):
  safepoint         CheckpointManager.restore(state): discover, verify size + crc32c of every file, load
                    with the safe reader, apply (set_state_dict, RNG).
  safepoint-noverify  the same load + apply without verification (Restorer.load), to split the cost.
  verify            Layout.verify alone.
  dcp               plain dcp.load into the same preallocated tensors (the model's and Adam's own).

Variants run interleaved (A, B, C, D, A, B, C, D, ...; the order rotates by one each round so no variant
always runs first) because disk throughput on shared VMs drifts by several x between runs. Ratios are
computed per round (paired); their median and quartiles are reported, next to the ratio of medians, and
CPU time (process + children) next to wall time. Restores on disk run cold (page cache dropped before each,
when the machine allows it) and warm; /dev/shm is a tmpfs, so its numbers isolate software from the disk.

    .venv/bin/python benchmarks/bench_save.py --size-mib 2048 --rounds 6

Results: tables on stdout, ``<out>/bench_save.json`` with every raw timing and ``<out>/bench_save.md`` with
the tables in Markdown; ``--render <json>`` reprints an earlier run.
Results: docs/benchmarks.md; runs and reading: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from _common import (
    MiB,
    add_location_args,
    drop_caches,
    load_1m,
    loadavg,
    machine_description,
    make_state,
    rotated,
    round_label,
    scratch_paths,
)
from _save_report import Run, markdown_tables, print_tables, summarize
from _save_variants import RESTORE_VARIANTS, SAVE_VARIANTS, Location
from rich.console import Console


def run_benchmark(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    paths = scratch_paths(args, "safepoint-bench", args.locations)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    can_drop = args.drop_caches and drop_caches()
    console.print(f"[bold]building state[/] ~{args.size_mib} MiB (params + Adam state) ...")
    t0 = time.perf_counter()
    state = make_state(args.size_mib * MiB)
    console.print(
        f"  {state.n_tensors} tensors, {state.nbytes / MiB:.0f} MiB, built in {time.perf_counter() - t0:.1f}s"
    )
    locations = {name: Location(name, p, state, args.threads) for name, p in paths.items()}
    # Everything alive now lives to the end: take it out of the collector's sight, so the gc.collect()
    # before each measurement costs milliseconds, not the 0.3 s a full pass over torch's objects takes.
    gc.collect()
    gc.freeze()
    meta = machine_description(paths)
    meta["drop_caches"] = can_drop
    meta["state"] = {"bytes": state.nbytes, "tensors": state.n_tensors}
    save_variants = [v for v in SAVE_VARIANTS if v in args.save_variants]
    restore_variants = [v for v in RESTORE_VARIANTS if v in args.restore_variants]
    runs: list[Run] = []

    def record(run: Run) -> None:
        run.loadavg_1m = load_1m()
        if run.round >= 0:
            runs.append(run)
        where = run.location if run.cache == "-" else f"{run.location}/{run.cache}"
        console.print(
            f"  [dim]{round_label(run.round):>8}  {run.phase:<7} {where:<10} {run.variant:<18} "
            f"{run.seconds:7.3f}s {state.nbytes / run.seconds / 1e6:8.0f} MB/s  cpu {run.cpu_s:6.2f}s  "
            f"load {run.loadavg_1m}[/]"
        )

    try:
        if save_variants:
            console.print(f"[bold]save[/]: {', '.join(save_variants)} x {args.rounds} rounds, interleaved")
            for rnd in range(-args.warmup, args.rounds):
                for loc in locations.values():
                    for pos, variant in enumerate(rotated(save_variants, rnd, args.rotate)):
                        os.sync()  # nobody's dirty pages (ours or other jobs') get flushed on our clock
                        gc.collect()
                        timing, nbytes = loc.save(variant)
                        record(
                            Run(
                                "save", loc.name, "-", variant, rnd, pos, timing.seconds, timing.cpu_s, nbytes
                            )
                        )
        if restore_variants:
            for loc in locations.values():
                loc.prepare_restore()
            caches = {n: (["cold", "warm"] if n == "disk" and can_drop else ["warm"]) for n in locations}
            console.print(
                f"[bold]restore[/]: {', '.join(restore_variants)} x {args.rounds} rounds, interleaved "
                f"(disk: {', '.join(caches.get('disk', []))})"
            )
            for rnd in range(-args.warmup, args.rounds):
                for loc in locations.values():
                    for cache in caches[loc.name]:
                        for pos, variant in enumerate(rotated(restore_variants, rnd, args.rotate)):
                            gc.collect()
                            if cache == "cold":
                                drop_caches()
                            t = loc.restore(variant)
                            record(
                                Run(
                                    "restore",
                                    loc.name,
                                    cache,
                                    variant,
                                    rnd,
                                    pos,
                                    t.seconds,
                                    t.cpu_s,
                                    state.nbytes,
                                )
                            )
    finally:
        for loc in locations.values():
            loc.close()
    meta["loadavg_at_end"] = loadavg()
    config = {
        "size_mib": args.size_mib,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "threads": args.threads,
        "torch_threads": torch.get_num_threads(),
        "rotate": args.rotate,
        "locations": list(paths),
        "save_variants": save_variants,
        "restore_variants": restore_variants,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    return {
        "meta": meta,
        "config": config,
        "runs": [dataclasses.asdict(r) for r in runs],
        "summary": summarize(runs, state.nbytes),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    def csv(s: str) -> list[str]:
        return [x for x in s.split(",") if x]

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=2048, help="total state size in MiB (default 2048)")
    p.add_argument(
        "--rounds", type=int, default=5, help="interleaved rounds (default 5; use a multiple of the variants)"
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument("--threads", type=int, default=1, help="DCP writer thread_count, same for all (default 1)")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1; 0 = torch's default). On a busy 2-core VM, OpenMP's "
        "second thread waits for a core at every parallel copy_: DCP's load ran 15x slower with 2 threads",
    )
    p.add_argument("--render", metavar="JSON", help="print the tables of an earlier run's JSON; run nothing")
    add_location_args(p)
    p.add_argument("--save-variants", type=csv, default=list(SAVE_VARIANTS), help=",".join(SAVE_VARIANTS))
    p.add_argument(
        "--restore-variants", type=csv, default=list(RESTORE_VARIANTS), help=",".join(RESTORE_VARIANTS)
    )
    p.add_argument(
        "--no-rotate", dest="rotate", action="store_false", help="the same variant order every round"
    )
    p.add_argument(
        "--no-drop-caches",
        dest="drop_caches",
        action="store_false",
        help="never drop the page cache (then all restores are warm-cache)",
    )
    args = p.parse_args(argv)
    for name, allowed in (
        ("locations", ("disk", "shm")),
        ("save_variants", SAVE_VARIANTS),
        ("restore_variants", RESTORE_VARIANTS),
    ):
        for v in getattr(args, name):
            if v not in allowed:
                p.error(f"--{name.replace('_', '-')}: unknown value {v!r} (choose from {', '.join(allowed)})")
    if args.size_mib < 1 or args.rounds < 1 or args.warmup < 0 or args.threads < 1 or args.torch_threads < 0:
        p.error("--size-mib, --rounds and --threads must be >= 1, --warmup and --torch-threads >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 150)
    if args.render:
        result = json.loads(Path(args.render).read_text())
        print_tables(console, result)
        print(markdown_tables(result))
        return 0
    result = run_benchmark(args, console)
    out = Path(args.out) / "bench_save.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    (out.parent / "bench_save.md").write_text(markdown_tables(result))
    print_tables(console, result)
    console.print(f"raw results: {out} (Markdown tables: {out.parent / 'bench_save.md'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
