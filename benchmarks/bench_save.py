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
the tables in Markdown; ``--render <json>`` reprints an earlier run. Results and reading: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from _common import (
    BenchState,
    MiB,
    Timing,
    add_location_args,
    drop_caches,
    fmt,
    fmt_spread,
    load_1m,
    loadavg,
    machine_description,
    machine_line,
    make_state,
    markdown_table,
    median,
    paired_ratios,
    print_table,
    quartiles,
    remove,
    rotated,
    round_label,
    scratch_paths,
    timed,
    tree_bytes,
)
from rich.console import Console
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import safepoint
from safepoint.dist import Comm
from safepoint.layout import Layout
from safepoint.policy import Retention
from safepoint.restore import Restorer
from safepoint.saver import SyncSaver

SAVE_VARIANTS = ("safepoint", "safepoint-writer", "dcp", "torch.save", "dd")
RESTORE_VARIANTS = ("safepoint", "safepoint-noverify", "verify", "dcp")
BASELINE = "dcp"
SAVE_TARGET = 0.95  # safepoint save throughput >= 0.95x plain DCP's
RESTORE_TARGET = 1.15  # safepoint restore time <= 1.15x plain DCP's
RESTORE_STEP = 1


# ---- the variants ---------------------------------------------------------------------------------------


class Location:
    """One place checkpoints go (disk or /dev/shm) and the managers writing there."""

    def __init__(self, name: str, base: Path, state: BenchState, threads: int) -> None:
        self.name = name
        self.base = base
        self.state = state
        self.threads = threads
        self.step = 1000
        base.mkdir(parents=True, exist_ok=True)
        self.mgr = safepoint.CheckpointManager(base / "safepoint", writer_threads=threads)
        writer_layout = Layout(base / "safepoint-writer")
        writer_layout.ensure_root()
        self.writer = SyncSaver(writer_layout, Comm(), Retention(), writer_threads=threads)
        self.restore_root = base / "restore"
        self.restore_mgr: safepoint.CheckpointManager | None = None

    def save(self, variant: str) -> tuple[Timing, int]:
        """Run one save variant; return its timing and the bytes it wrote, then delete what it wrote."""
        self.step += 1
        step, plain, nbytes = self.step, self.state.plain, self.state.nbytes
        state = self.state.train_state()
        outs = {
            "safepoint": Path(self.mgr.layout.step_path(step)),
            "safepoint-writer": self.writer.layout.step_path(step),
            "dcp": self.base / f"dcp-{step}",
            "torch.save": self.base / f"torch-{step}.pt",
            "dd": self.base / f"dd-{step}.bin",
        }
        if variant not in outs:
            raise ValueError(f"unknown save variant {variant!r}")
        out = outs[variant]

        def run_dcp() -> None:
            writer = FileSystemWriter(
                out, single_file_per_rank=True, sync_files=True, thread_count=self.threads
            )
            dcp_save(plain, storage_writer=writer, no_dist=True)

        def run_torch_save() -> None:
            with open(out, "wb") as f:
                torch.save(plain, f)
                f.flush()
                os.fsync(f.fileno())

        dd = ["dd", "if=/dev/zero", f"of={out}", "bs=64M", f"count={nbytes}", "iflag=count_bytes"]
        run: dict[str, Callable[[], object]] = {
            "safepoint": lambda: self.mgr.save(step, state),
            "safepoint-writer": lambda: self.writer.write(step, plain, ["model", "optimizer"], {}, {}),
            "dcp": run_dcp,
            "torch.save": run_torch_save,
            "dd": lambda: subprocess.run([*dd, "conv=fdatasync", "status=none"], check=True),
        }
        timing = timed(run[variant])
        written = tree_bytes(out)
        remove(out)
        return timing, written

    # restore

    def prepare_restore(self) -> int:
        """One committed safepoint checkpoint (also a plain DCP directory) that every restore reads."""
        self.restore_mgr = safepoint.CheckpointManager(self.restore_root, writer_threads=self.threads)
        info = self.restore_mgr.save(RESTORE_STEP, self.state.train_state())
        assert info is not None  # a sync manager returns what it committed
        return info.bytes

    def restore(self, variant: str) -> Timing:
        assert self.restore_mgr is not None
        mgr = self.restore_mgr
        step_dir = Path(mgr.layout.step_path(RESTORE_STEP))
        if variant == "safepoint":
            state = self.state.train_state()

            def run_restore() -> None:
                if mgr.restore(state) != RESTORE_STEP:
                    raise RuntimeError("safepoint restored the wrong step")

            return timed(run_restore)
        if variant == "safepoint-noverify":
            state = self.state.train_state()
            restorer = Restorer(mgr.layout, mgr.comm)
            return timed(lambda: restorer.load(mgr.layout.read_manifest(RESTORE_STEP), state))
        if variant == "verify":
            return timed(lambda: mgr.layout.verify(RESTORE_STEP))
        if variant == "dcp":
            return timed(
                lambda: dcp_load(self.state.plain, storage_reader=FileSystemReader(step_dir), no_dist=True)
            )
        raise ValueError(f"unknown restore variant {variant!r}")

    def close(self) -> None:
        self.mgr.close()
        if self.restore_mgr is not None:
            self.restore_mgr.close()
        shutil.rmtree(self.base, ignore_errors=True)


# ---- the run --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    phase: str  # save | restore
    location: str  # disk | shm
    cache: str  # save: "-"; restore: cold | warm
    variant: str
    round: int
    position: int
    """Where in its round's order the variant ran (orders rotate from round to round)."""
    seconds: float
    cpu_s: float
    bytes: int
    loadavg_1m: float | None = None


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


def summarize(runs: list[Run], nbytes: int) -> list[dict[str, Any]]:
    """Per (phase, location, cache, variant): median/min/max seconds, MB/s, ratios vs plain DCP.

    Save ratios are throughput ratios (DCP time / variant time: > 1 is faster than DCP); restore ratios
    are time ratios (variant time / DCP time: < 1 is faster). ``paired_ratio`` is the median of the
    per-round ratios (robust to drift between rounds); ``ratio_of_medians`` is the plain ratio.
    """
    rows: list[dict[str, Any]] = []
    groups = sorted({(r.phase, r.location, r.cache) for r in runs}, key=lambda g: (g[0] != "save", g))
    for phase, location, cache in groups:
        group = [r for r in runs if (r.phase, r.location, r.cache) == (phase, location, cache)]
        secs: dict[str, dict[int, float]] = {}
        cpus: dict[str, dict[int, float]] = {}
        for r in group:
            secs.setdefault(r.variant, {})[r.round] = r.seconds
            cpus.setdefault(r.variant, {})[r.round] = r.cpu_s
        base, cpu_base = secs.get(BASELINE, {}), cpus.get(BASELINE, {})
        save = phase == "save"
        for variant in [v for v in (SAVE_VARIANTS if save else RESTORE_VARIANTS) if v in secs]:
            times = secs[variant]
            med = median(times.values())
            ratios = paired_ratios(times, base, (lambda t, b: b / t) if save else (lambda t, b: t / b))
            cpu_ratios = paired_ratios(cpus[variant], cpu_base, lambda c, b: c / b)
            row: dict[str, Any] = {
                "phase": phase,
                "location": location,
                "cache": cache,
                "variant": variant,
                "n": len(times),
                "median_s": med,
                "min_s": min(times.values()),
                "max_s": max(times.values()),
                "mb_s": nbytes / med / 1e6,
                "cpu_median_s": median(cpus[variant].values()),
                "ratio_of_medians": None,
                "paired_ratio": median(ratios) if ratios else None,
                "paired_ratio_q1_q3": quartiles(ratios) if ratios else None,
                "ratio_kind": "throughput x DCP" if save else "time x DCP",
                "cpu_paired_ratio": median(cpu_ratios) if cpu_ratios else None,
                "target": None,
                "met": None,
            }
            if base:
                base_med = median(base.values())
                row["ratio_of_medians"] = base_med / med if save else med / base_med
            if variant == "safepoint" and row["paired_ratio"] is not None:
                target = SAVE_TARGET if save else RESTORE_TARGET
                row["target"] = f"{'>=' if save else '<='} {target}"
                row["met"] = row["paired_ratio"] >= target if save else row["paired_ratio"] <= target
            rows.append(row)
    return rows


COLUMNS = (
    "where",
    "variant",
    "median s",
    "min s",
    "max s",
    "MB/s",
    "x DCP paired (q1-q3)",
    "x DCP medians",
    "cpu s",
    "cpu x DCP",
    "target",
)


def _cells(r: dict[str, Any], rich: bool) -> list[str]:
    verdict = ""
    if r["target"] is not None:
        met = ("[green]met[/]" if rich else "met") if r["met"] else ("[red]missed[/]" if rich else "missed")
        verdict = f"{r['target']}: {met}"
    return [
        r["location"] if r["cache"] == "-" else f"{r['location']} {r['cache']}",
        r["variant"],
        f"{r['median_s']:.3f}",
        f"{r['min_s']:.3f}",
        f"{r['max_s']:.3f}",
        f"{r['mb_s']:.0f}",
        fmt_spread(r["paired_ratio"], r["paired_ratio_q1_q3"]),
        fmt(r["ratio_of_medians"]),
        f"{r['cpu_median_s']:.2f}",
        fmt(r["cpu_paired_ratio"]),
        verdict,
    ]


def _caption(result: dict[str, Any], phase: str, n: int) -> str:
    kind = "throughput x DCP, higher is better" if phase == "save" else "time x DCP, lower is better"
    return (
        f"{phase} ({result['meta']['state']['bytes'] / MiB:.0f} MiB, {n} rounds; ratio = {kind}; "
        "cpu x DCP = CPU time ratio, lower is better)"
    )


def print_tables(console: Console, result: dict[str, Any]) -> None:
    console.print(machine_line(result["meta"]) + f"; page cache dropped: {result['meta'].get('drop_caches')}")
    for phase in ("save", "restore"):
        rows = [r for r in result["summary"] if r["phase"] == phase]
        if rows:
            print_table(
                console, _caption(result, phase, rows[0]["n"]), COLUMNS, [_cells(r, True) for r in rows]
            )


def markdown_tables(result: dict[str, Any]) -> str:
    """The summary as Markdown tables (what docs/benchmarks.md quotes)."""
    parts = []
    for phase in ("save", "restore"):
        rows = [r for r in result["summary"] if r["phase"] == phase]
        if rows:
            table = markdown_table(COLUMNS, [_cells(r, False) for r in rows])
            parts.append(f"**{_caption(result, phase, rows[0]['n'])}**\n\n{table}\n")
    return "\n".join(parts)


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
