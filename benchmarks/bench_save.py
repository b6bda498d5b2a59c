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

    .venv/bin/python benchmarks/bench_save.py --size-mib 2048 --rounds 5

Results: tables on stdout, ``<out>/bench_save.json`` with every raw timing and ``<out>/bench_save.md`` with
the tables in Markdown; ``--render <json>`` reprints an earlier run. Results and reading: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import crc32c
import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import safepoint
from safepoint.dist import Comm
from safepoint.layout import Layout
from safepoint.policy import Retention
from safepoint.restore import Restorer
from safepoint.saver import SyncSaver

MiB = 1024 * 1024
SAVE_VARIANTS = ("safepoint", "safepoint-writer", "dcp", "torch.save", "dd")
RESTORE_VARIANTS = ("safepoint", "safepoint-noverify", "verify", "dcp")
BASELINE = "dcp"
SAVE_TARGET = 0.95  # safepoint save throughput >= 0.95x plain DCP's
RESTORE_TARGET = 1.15  # safepoint restore time <= 1.15x plain DCP's
RESTORE_STEP = 1
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


# ---- the state ------------------------------------------------------------------------------------------


class BenchModel(nn.Module):
    """A bag of fp32 parameters shaped like a small transformer (embedding, per-layer matrices, norms)."""

    def __init__(self, shapes: Sequence[tuple[str, tuple[int, ...]]]) -> None:
        super().__init__()
        for name, shape in shapes:
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))


def model_shapes(param_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter shapes adding up to about ``param_bytes`` of fp32: ~25% embedding, the rest in layers."""
    hidden = 64
    while hidden < 1024 and 12 * (2 * hidden) ** 2 * 4 <= param_bytes // 8:
        hidden *= 2
    h = hidden
    layer = [
        ("qkv", (3 * h, h)),
        ("proj", (h, h)),
        ("fc1", (4 * h, h)),
        ("fc1_bias", (4 * h,)),
        ("fc2", (h, 4 * h)),
        ("norm1", (h,)),
        ("norm2", (h,)),
    ]
    layer_bytes = 4 * sum(_numel(s) for _, s in layer)
    n_layers = max(1, int(0.75 * param_bytes) // layer_bytes)
    vocab = max(1, (param_bytes - n_layers * layer_bytes) // (4 * h))
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed", (vocab, h))]
    for i in range(n_layers):
        shapes.extend((f"l{i}_{name}", shape) for name, shape in layer)
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclasses.dataclass
class BenchState:
    model: BenchModel
    optimizer: torch.optim.Adam
    plain: dict[str, Any]
    """{"model": ..., "optimizer": ...} from get_state_dict: the very tensors the model and Adam hold."""
    nbytes: int
    n_tensors: int


def make_state(size_bytes: int, seed: int = 0) -> BenchState:
    """Parameters + Adam state (2 moments) adding up to ``size_bytes``; one real Adam step fills them."""
    torch.manual_seed(seed)
    model = BenchModel(model_shapes(size_bytes // 3))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    model_sd, optim_sd = get_state_dict(model, [opt])
    plain = {"model": model_sd, "optimizer": optim_sd}
    tensors = _tensors(plain)
    return BenchState(
        model=model,
        optimizer=opt,
        plain=plain,
        nbytes=sum(t.numel() * t.element_size() for t in tensors),
        n_tensors=len(tensors),
    )


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


# ---- helpers --------------------------------------------------------------------------------------------


def drop_caches() -> bool:
    """sync, then drop the page cache (root only; sandboxes may refuse). True if it worked."""
    os.sync()
    try:
        DROP_CACHES.write_text("3\n")
    except OSError:
        return False
    return True


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


@dataclasses.dataclass
class Timing:
    seconds: float
    """Wall clock."""
    cpu_s: float
    """CPU time of this process (all threads) and of children (dd): steadier than wall time on a shared
    machine, and it shows software overhead (checksums, copies) that a slow disk would hide."""

    def pair(self) -> tuple[float, float]:
        return self.seconds, self.cpu_s


def timed(fn: Callable[[], object]) -> Timing:
    c0 = _cpu()
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    return Timing(wall, _cpu() - c0)


def _cpu() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def fs_description(path: Path) -> dict[str, Any]:
    """Device, file system type and free space of the mount holding ``path``."""
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
        "size_gb": round(st.f_blocks * st.f_frsize / 1e9, 1),
        "free_gb": round(st.f_bavail * st.f_frsize / 1e9, 1),
    }


def machine_description(locations: dict[str, Path], can_drop: bool) -> dict[str, Any]:
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
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "kernel": platform.release(),
        "cpu": cpu,
        "nproc": os.cpu_count(),
        "ram_gib": round(mem_kb / MiB, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safepoint": safepoint.__version__,
        "crc32c": getattr(crc32c, "__version__", "?"),
        "crc32c_hardware_based": bool(crc32c.hardware_based),
        "torch_threads": torch.get_num_threads(),
        "drop_caches": can_drop,
        "locations": {name: fs_description(path) for name, path in locations.items()},
    }


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

    def train_state(self) -> safepoint.TrainState:
        return safepoint.TrainState(model=self.state.model, optimizer=self.state.optimizer)

    # save: each returns (timing, bytes written) and deletes what it wrote

    def save(self, variant: str) -> tuple[Timing, int]:
        self.step += 1
        step = self.step
        if variant == "safepoint":
            state = self.train_state()
            timing = timed(lambda: self.mgr.save(step, state))
            out = Path(self.mgr.layout.step_path(step))
        elif variant == "safepoint-writer":
            out = self.writer.layout.step_path(step)
            timing = timed(lambda: self.writer.write(step, self.state.plain, ["model", "optimizer"], {}, {}))
        elif variant == "dcp":
            out = self.base / f"dcp-{step}"

            def run_dcp() -> None:
                writer = FileSystemWriter(
                    out, single_file_per_rank=True, sync_files=True, thread_count=self.threads
                )
                dcp_save(self.state.plain, storage_writer=writer, no_dist=True)

            timing = timed(run_dcp)
        elif variant == "torch.save":
            out = self.base / f"torch-{step}.pt"

            def run_torch_save() -> None:
                with open(out, "wb") as f:
                    torch.save(self.state.plain, f)
                    f.flush()
                    os.fsync(f.fileno())

            timing = timed(run_torch_save)
        elif variant == "dd":
            out = self.base / f"dd-{step}.bin"
            cmd = [
                "dd",
                "if=/dev/zero",
                f"of={out}",
                "bs=64M",
                f"count={self.state.nbytes}",
                "iflag=count_bytes",
                "conv=fdatasync",
                "status=none",
            ]
            timing = timed(lambda: subprocess.run(cmd, check=True))
        else:
            raise ValueError(f"unknown save variant {variant!r}")
        nbytes = tree_bytes(out)
        remove(out)
        return timing, nbytes

    # restore

    def prepare_restore(self) -> int:
        """One committed safepoint checkpoint (also a plain DCP directory) that every restore reads."""
        self.restore_mgr = safepoint.CheckpointManager(self.restore_root, writer_threads=self.threads)
        info = self.restore_mgr.save(RESTORE_STEP, self.train_state())
        assert info is not None  # a sync manager returns what it committed
        return info.bytes

    def restore(self, variant: str) -> Timing:
        assert self.restore_mgr is not None
        mgr = self.restore_mgr
        step_dir = Path(mgr.layout.step_path(RESTORE_STEP))
        if variant == "safepoint":
            state = self.train_state()

            def run_restore() -> None:
                if mgr.restore(state) != RESTORE_STEP:
                    raise RuntimeError("safepoint restored the wrong step")

            return timed(run_restore)
        if variant == "safepoint-noverify":
            state = self.train_state()
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


def run_benchmark(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = f"safepoint-bench-{os.getpid()}"
    paths: dict[str, Path] = {}
    if "disk" in args.locations:
        paths["disk"] = Path(args.disk_dir or out_dir / "scratch") / tag
    if "shm" in args.locations:
        paths["shm"] = Path(args.shm_dir) / tag
    for p in paths.values():
        p.parent.mkdir(parents=True, exist_ok=True)

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
    meta = machine_description(paths, can_drop)
    meta["state"] = {"bytes": state.nbytes, "tensors": state.n_tensors}
    save_variants = [v for v in SAVE_VARIANTS if v in args.save_variants]
    restore_variants = [v for v in RESTORE_VARIANTS if v in args.restore_variants]
    runs: list[Run] = []
    try:
        if save_variants:
            console.print(
                f"[bold]save[/]: {', '.join(save_variants)} x {args.rounds} rounds, interleaved"
                + (", order rotated each round" if args.rotate else "")
            )
            for rnd in range(-args.warmup, args.rounds):
                for loc in locations.values():
                    for pos, variant in enumerate(_order(save_variants, rnd, args.rotate)):
                        os.sync()  # nobody's dirty pages (ours or other jobs') get flushed on our clock
                        gc.collect()
                        timing, nbytes = loc.save(variant)
                        run = Run("save", loc.name, "-", variant, rnd, pos, *timing.pair(), nbytes)
                        if rnd >= 0:
                            runs.append(run)
                        _progress(console, run, state.nbytes)
        if restore_variants:
            for loc in locations.values():
                loc.prepare_restore()
            caches = {
                name: (["cold", "warm"] if name == "disk" and can_drop else ["warm"]) for name in locations
            }
            console.print(
                f"[bold]restore[/]: {', '.join(restore_variants)} x {args.rounds} rounds, interleaved "
                f"(disk: {', '.join(caches.get('disk', []))})"
            )
            for rnd in range(-args.warmup, args.rounds):
                for loc in locations.values():
                    for cache in caches[loc.name]:
                        for pos, variant in enumerate(_order(restore_variants, rnd, args.rotate)):
                            gc.collect()
                            if cache == "cold":
                                drop_caches()
                            timing = loc.restore(variant)
                            run = Run(
                                "restore", loc.name, cache, variant, rnd, pos, *timing.pair(), state.nbytes
                            )
                            if rnd >= 0:
                                runs.append(run)
                            _progress(console, run, state.nbytes)
    finally:
        for loc in locations.values():
            loc.close()

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


def _order(variants: list[str], rnd: int, rotate: bool) -> list[str]:
    """Round r runs the variants rotated by r: every variant takes every position equally often (with
    rounds a multiple of the variant count), so "first after the other location" or "right after a
    cache drop" effects do not land on one variant."""
    k = rnd % len(variants) if rotate and rnd >= 0 else 0
    return variants[k:] + variants[:k]


def _progress(console: Console, run: Run, nbytes: int) -> None:
    label = "warmup" if run.round < 0 else f"round {run.round}"
    where = run.location if run.cache == "-" else f"{run.location}/{run.cache}"
    console.print(
        f"  [dim]{label:>8}  {run.phase:<7} {where:<10} {run.variant:<18} {run.seconds:7.3f}s "
        f"{nbytes / run.seconds / 1e6:8.0f} MB/s  cpu {run.cpu_s:6.2f}s[/]"
    )


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
        by_variant: dict[str, dict[int, float]] = {}
        cpu_by_variant: dict[str, dict[int, float]] = {}
        for r in group:
            by_variant.setdefault(r.variant, {})[r.round] = r.seconds
            cpu_by_variant.setdefault(r.variant, {})[r.round] = r.cpu_s
        base = by_variant.get(BASELINE, {})
        cpu_base = cpu_by_variant.get(BASELINE, {})
        order = SAVE_VARIANTS if phase == "save" else RESTORE_VARIANTS
        for variant in [v for v in order if v in by_variant]:
            times = by_variant[variant]
            cpus = cpu_by_variant[variant]
            med = statistics.median(times.values())
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
                "cpu_median_s": statistics.median(cpus.values()),
                "ratio_of_medians": None,
                "paired_ratio": None,
                "paired_ratio_q1_q3": None,
                "ratio_kind": "throughput x DCP" if phase == "save" else "time x DCP",
                "cpu_paired_ratio": None,
                "target": None,
                "met": None,
            }
            paired = [
                (base[k] / t if phase == "save" else t / base[k]) for k, t in times.items() if k in base
            ]
            if base:
                base_med = statistics.median(base.values())
                row["ratio_of_medians"] = base_med / med if phase == "save" else med / base_med
            if paired:
                row["paired_ratio"] = statistics.median(paired)
                row["paired_ratio_q1_q3"] = _quartiles(paired)
            cpu_paired = [c / cpu_base[k] for k, c in cpus.items() if cpu_base.get(k)]
            if cpu_paired:
                row["cpu_paired_ratio"] = statistics.median(cpu_paired)
            if variant == "safepoint" and row["paired_ratio"] is not None:
                if phase == "save":
                    row["target"] = f">= {SAVE_TARGET}"
                    row["met"] = row["paired_ratio"] >= SAVE_TARGET
                else:
                    row["target"] = f"<= {RESTORE_TARGET}"
                    row["met"] = row["paired_ratio"] <= RESTORE_TARGET
            rows.append(row)
    return rows


def print_tables(console: Console, result: dict[str, Any]) -> None:
    meta = result["meta"]
    console.print(
        f"\n[bold]machine[/]: {meta['nproc']} cpus ({meta['cpu']}), {meta['ram_gib']} GiB RAM, torch "
        f"{meta['torch']}, crc32c {meta['crc32c']} (hardware: {meta['crc32c_hardware_based']}), "
        f"page cache dropped for cold restores: {meta['drop_caches']}"
    )
    for phase in ("save", "restore"):
        rows = [r for r in result["summary"] if r["phase"] == phase]
        if not rows:
            continue
        kind = "throughput x DCP (higher is better)" if phase == "save" else "time x DCP (lower is better)"
        table = Table(title=f"{phase}: {result['meta']['state']['bytes'] / MiB:.0f} MiB, ratios = {kind}")
        columns = (
            "where",
            "variant",
            "median s",
            "min s",
            "max s",
            "MB/s",
            "x DCP paired (q1-q3)",
            "x DCP medians",
        )
        for col in (*columns, "cpu s", "cpu x DCP"):
            table.add_column(col, justify="left" if col in ("where", "variant") else "right")
        table.add_column("target")
        last_where = None
        for r in rows:
            where = r["location"] if r["cache"] == "-" else f"{r['location']} {r['cache']}"
            if last_where is not None and where != last_where:
                table.add_section()
            last_where = where
            verdict = ""
            if r["target"] is not None:
                verdict = f"{r['target']} " + ("[green]met[/]" if r["met"] else "[red]missed[/]")
            table.add_row(
                where,
                r["variant"],
                f"{r['median_s']:.3f}",
                f"{r['min_s']:.3f}",
                f"{r['max_s']:.3f}",
                f"{r['mb_s']:.0f}",
                _fmt_paired(r),
                _fmt_ratio(r["ratio_of_medians"]),
                f"{r['cpu_median_s']:.2f}",
                _fmt_ratio(r["cpu_paired_ratio"]),
                verdict,
            )
        console.print(table)


def _quartiles(xs: list[float]) -> tuple[float, float]:
    """First and third quartile (the spread of the per-round ratios); min and max below 4 samples."""
    if len(xs) < 4:
        return min(xs), max(xs)
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def _fmt_paired(row: dict[str, Any]) -> str:
    if row["paired_ratio"] is None:
        return ""
    q1, q3 = row["paired_ratio_q1_q3"]
    return f"{row['paired_ratio']:.3f} ({q1:.2f}-{q3:.2f})"


def _fmt_ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=2048, help="total state size in MiB (default 2048)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per variant (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument("--threads", type=int, default=1, help="DCP writer thread_count, same for all (default 1)")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1; 0 = torch's default). On a busy 2-core VM, OpenMP's "
        "second thread waits for a core at every parallel copy_: DCP's load ran 15x slower with 2 threads",
    )
    p.add_argument("--out", default="bench-out", help="results directory (default bench-out/)")
    p.add_argument("--render", metavar="JSON", help="print the tables of an earlier run's JSON; run nothing")
    p.add_argument(
        "--locations",
        default="disk,shm",
        type=lambda s: [x for x in s.split(",") if x],
        help="comma list of disk,shm (default both)",
    )
    p.add_argument("--disk-dir", default=None, help="scratch directory on disk (default <out>/scratch)")
    p.add_argument("--shm-dir", default="/dev/shm", help="scratch directory on tmpfs (default /dev/shm)")
    p.add_argument(
        "--save-variants",
        default=",".join(SAVE_VARIANTS),
        type=lambda s: [x for x in s.split(",") if x],
        help=f"comma list of {','.join(SAVE_VARIANTS)} (empty: skip saves)",
    )
    p.add_argument(
        "--restore-variants",
        default=",".join(RESTORE_VARIANTS),
        type=lambda s: [x for x in s.split(",") if x],
        help=f"comma list of {','.join(RESTORE_VARIANTS)} (empty: skip restores)",
    )
    p.add_argument(
        "--no-rotate",
        dest="rotate",
        action="store_false",
        help="run the variants in the same order every round (default: rotate the order by one per round)",
    )
    p.add_argument(
        "--no-drop-caches",
        dest="drop_caches",
        action="store_false",
        help="never drop the page cache (then all restores are warm-cache)",
    )
    args = p.parse_args(argv)
    for loc in args.locations:
        if loc not in ("disk", "shm"):
            p.error(f"--locations: unknown location {loc!r}")
    for v in args.save_variants:
        if v not in SAVE_VARIANTS:
            p.error(f"--save-variants: unknown variant {v!r}")
    for v in args.restore_variants:
        if v not in RESTORE_VARIANTS:
            p.error(f"--restore-variants: unknown variant {v!r}")
    if args.size_mib < 1 or args.rounds < 1 or args.warmup < 0 or args.threads < 1 or args.torch_threads < 0:
        p.error("--size-mib, --rounds and --threads must be >= 1, --warmup and --torch-threads >= 0")
    return args


def markdown_tables(result: dict[str, Any]) -> str:
    """The summary as Markdown tables (what docs/benchmarks.md quotes)."""
    lines: list[str] = []
    for phase in ("save", "restore"):
        rows = [r for r in result["summary"] if r["phase"] == phase]
        if not rows:
            continue
        kind = "throughput x DCP, higher is better" if phase == "save" else "time x DCP, lower is better"
        lines += [
            f"**{phase}** ({result['meta']['state']['bytes'] / MiB:.0f} MiB, {rows[0]['n']} rounds; "
            f"ratio = {kind}; cpu x DCP = CPU time ratio, lower is better)",
            "",
            "| where | variant | median s | min s | max s | MB/s | x DCP paired (q1-q3) | x DCP medians "
            "| cpu s | cpu x DCP | target |",
            "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|",
        ]
        for r in rows:
            where = r["location"] if r["cache"] == "-" else f"{r['location']} {r['cache']}"
            target = "" if r["target"] is None else f"{r['target']}: {'met' if r['met'] else 'missed'}"
            lines.append(
                f"| {where} | {r['variant']} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['max_s']:.3f} "
                f"| {r['mb_s']:.0f} | {_fmt_paired(r)} | {_fmt_ratio(r['ratio_of_medians'])} "
                f"| {r['cpu_median_s']:.2f} | {_fmt_ratio(r['cpu_paired_ratio'])} | {target} |"
            )
        lines.append("")
    return "\n".join(lines)


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
