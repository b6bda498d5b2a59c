"""What the benchmark scripts share: the state they save, interleaving, timing, statistics and tables.

On the shared 2-core development VMs, disk throughput and CPU availability drift by several x within
minutes, so every script runs its variants interleaved, rotates their order from round to round, pairs each
variant with its baseline of the same round, and reports the median of those paired ratios with their
quartiles. The machine's load average is recorded at the start and end of every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import os
import platform
import resource
import shutil
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import crc32c
import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

import safepoint

MiB = 1024 * 1024
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


# ---- the state ------------------------------------------------------------------------------------------


class BenchModel(nn.Module):
    """A bag of fp32 parameters shaped like a small transformer (embedding, per-layer matrices, norms)."""

    def __init__(self, shapes: Sequence[tuple[str, tuple[int, ...]]]) -> None:
        super().__init__()
        for name, shape in shapes:
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))


def numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


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
    layer_bytes = 4 * sum(numel(s) for _, s in layer)
    n_layers = max(1, int(0.75 * param_bytes) // layer_bytes)
    vocab = max(1, (param_bytes - n_layers * layer_bytes) // (4 * h))
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed", (vocab, h))]
    for i in range(n_layers):
        shapes.extend((f"l{i}_{name}", shape) for name, shape in layer)
    return shapes


@dataclasses.dataclass
class BenchState:
    model: BenchModel
    optimizer: torch.optim.Adam
    plain: dict[str, Any]
    """{"model": ..., "optimizer": ...} from get_state_dict: the very tensors the model and Adam hold."""
    nbytes: int
    n_tensors: int

    def train_state(self) -> safepoint.TrainState:
        return safepoint.TrainState(model=self.model, optimizer=self.optimizer)


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
    found = tensors(plain)
    return BenchState(model, opt, plain, sum(t.numel() * t.element_size() for t in found), len(found))


def tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors(v)]
    return []


def nbytes_of(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(obj))


# ---- interleaving and timing ----------------------------------------------------------------------------


def rotated(variants: Sequence[str], rnd: int, rotate: bool = True) -> list[str]:
    """Round r runs the variants rotated by r: every variant takes every position equally often (with
    rounds a multiple of the variant count), so "first after the other location" or "right after a cache
    drop" effects do not land on one variant. Warm-up rounds (r < 0) keep the given order."""
    k = rnd % len(variants) if rotate and rnd >= 0 and variants else 0
    return [*variants[k:], *variants[:k]]


def round_label(rnd: int) -> str:
    return "warmup" if rnd < 0 else f"round {rnd}"


@dataclasses.dataclass
class Timing:
    seconds: float
    """Wall clock."""
    cpu_s: float
    """CPU time of this process (all threads) and of its children (dd): steadier than wall time on a shared
    machine, and it shows software overhead (checksums, copies) that a slow disk would hide."""


def cpu_time() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def timed(fn: Callable[[], object]) -> Timing:
    c0 = cpu_time()
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    return Timing(wall, cpu_time() - c0)


def load_1m() -> float | None:
    """The 1-minute load average now (None where the OS has none)."""
    avg = loadavg()
    return avg[0] if avg else None


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


# ---- statistics -----------------------------------------------------------------------------------------


Ratio = Callable[[float, float], float]


def median(xs: Iterable[float]) -> float:
    values = list(xs)
    return statistics.median(values) if values else float("nan")


def quartiles(xs: Sequence[float]) -> tuple[float, float]:
    """First and third quartile (the spread of the per-round ratios); min and max below 4 samples."""
    if len(xs) < 4:
        return min(xs), max(xs)
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def paired_ratios(
    a: dict[int, float], b: dict[int, float], fn: Callable[[float, float], float]
) -> list[float]:
    """fn(a[r], b[r]) for every round both have."""
    return [fn(a[r], b[r]) for r in a if b.get(r)]


def paired(a: dict[int, float], b: dict[int, float], fn: Ratio) -> float | None:
    """Median over rounds of fn(a[r], b[r])."""
    vals = paired_ratios(a, b, fn)
    return statistics.median(vals) if vals else None


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "" if x is None else format(x, spec)


def fmt_spread(mid: float | None, spread: Sequence[float] | None, brackets: str = "()") -> str:
    if mid is None:
        return ""
    if not spread:
        return f"{mid:.3f}"
    return f"{mid:.3f} {brackets[0]}{spread[0]:.2f}-{spread[1]:.2f}{brackets[1]}"


# ---- tables ---------------------------------------------------------------------------------------------


def print_table(
    console: Console, title: str, columns: Sequence[str], cells: Iterable[Sequence[str]], group_by: int = 0
) -> None:
    """A rich table; a separator line whenever column ``group_by`` changes. The first columns that hold
    words (not numbers) are left-aligned: those listed before the first numeric column."""
    table = Table(title=escape(title))
    rows = [list(r) for r in cells]
    text_cols = _text_columns(columns, rows)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i in text_cols else "right")
    last = None
    for r in rows:
        if last is not None and r[group_by] != last:
            table.add_section()
        last = r[group_by]
        table.add_row(*r)
    console.print(table)


def markdown_table(columns: Sequence[str], cells: Iterable[Sequence[str]]) -> str:
    rows = [list(r) for r in cells]
    text_cols = _text_columns(columns, rows)
    align = ["---" if i in text_cols else "--:" for i in range(len(columns))]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(_plain(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _text_columns(columns: Sequence[str], rows: list[list[str]]) -> set[int]:
    def numeric(s: str) -> bool:
        head = s.split(" ")[0].rstrip("%")
        try:
            float(head)
        except ValueError:
            return False
        return True

    return {i for i in range(len(columns)) if not any(numeric(r[i]) for r in rows if r[i])}


def _plain(cell: str) -> str:
    for tag in ("[green]", "[red]", "[yellow]", "[dim]", "[/]"):
        cell = cell.replace(tag, "")
    return cell


# ---- the machine and the scratch directories ------------------------------------------------------------


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
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "kernel": platform.release(),
        "cpu": cpu,
        "nproc": os.cpu_count(),
        "ram_gib": round(mem_kb / MiB, 1),
        "loadavg_at_start": loadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safepoint": safepoint.__version__,
        "crc32c": getattr(crc32c, "__version__", "?"),
        "crc32c_hardware_based": bool(crc32c.hardware_based),
        "torch_threads": torch.get_num_threads(),
        "locations": {name: fs_description(path) for name, path in locations.items()},
    }


def machine_line(meta: dict[str, Any]) -> str:
    return (
        f"\n[bold]machine[/]: {meta['nproc']} cpus ({meta['cpu']}), {meta['ram_gib']} GiB RAM, torch "
        f"{meta['torch']}, crc32c hardware {meta['crc32c_hardware_based']}; load average (1, 5, 15 min) "
        f"at start {meta.get('loadavg_at_start')}, at end {meta.get('loadavg_at_end')}"
    )


def add_location_args(p: argparse.ArgumentParser) -> None:
    def csv(s: str) -> list[str]:
        return [x for x in s.split(",") if x]

    p.add_argument("--out", default="bench-out", help="results directory (default bench-out/)")
    p.add_argument("--locations", type=csv, default=["disk", "shm"], help="disk,shm (default both)")
    p.add_argument("--disk-dir", default=None, help="scratch directory on disk (default <out>/scratch)")
    p.add_argument("--shm-dir", default="/dev/shm", help="scratch directory on tmpfs (default /dev/shm)")


def scratch_paths(args: argparse.Namespace, tag: str, names: Iterable[str]) -> dict[str, Path]:
    """{"disk"|"shm": a fresh per-run directory} for the locations asked for."""
    paths: dict[str, Path] = {}
    for name in names:
        if name == "disk":
            paths[name] = Path(args.disk_dir or Path(args.out) / "scratch") / f"{tag}-{os.getpid()}"
        elif name == "shm":
            paths[name] = Path(args.shm_dir) / f"{tag}-{os.getpid()}"
        else:
            raise ValueError(f"unknown location {name!r} (choose from disk, shm)")
        paths[name].mkdir(parents=True, exist_ok=True)
    return paths


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


def linear_adam(layers: int, width: int = 132) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``layers`` x ``Linear(width, width)`` with Adam, one step taken (every optimizer buffer exists): the
    many-small-tensors state of issue 16 (1,250 layers: 10,018 DCP items; 625: the 5,000-tensor variant)."""
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt
