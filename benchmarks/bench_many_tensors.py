#!/usr/bin/env python
"""Issue 27: the per-parameter cost of a save and a restore of many small tensors, against torch and DCP.

The state: ``nn.ParameterList`` of N x (64, 64) fp32 parameters + Adam, one step taken (4 DCP items per
parameter: the weight, exp_avg, exp_avg_sq, step). For each N, on a tmpfs by default:

  steady save   a manager's 3rd and later sync ``save()`` (plans cached)     vs torch.save + fsync, dcp.save
  first save    a new process: ``CheckpointManager(...)`` + its first save  vs torch.save + fsync there
  restore       ``restore()`` (verifies every crc32c, loads, applies)      vs torch.load + load_state_dict
                                                                             (model and optimizer), dcp.load

Variants of a phase run interleaved, their order rotating each round; the figure is CPU time (process +
children: the steadier figure on a shared machine) per parameter in µs, with wall time beside it, the
median over rounds, and the paired ratio against the torch baseline. The 1-minute load average is printed
with every round. ``--profile PHASE`` prints a cProfile of one safepoint run of that phase instead.

The first save also splits its main thread's wall time (``/proc/thread-self/schedstat``): on a CPU, waiting
in the run queue for one (the machine's load: on 2 shared cores most of the gap between wall and CPU), and
the rest, blocked (fsync, I/O, a lock, a thread). ``wall - queue`` is what the save would take on an idle
machine, and its paired ratio is printed beside the wall and CPU ones. ``--other NAME=SRC`` adds a safepoint
variant whose child runs with ``PYTHONPATH=SRC`` (an A/B against another tree, interleaved in the same
rounds); a run of the first save alone builds no state in the parent (each child builds its own).

    python benchmarks/bench_many_tensors.py --n 1000,5000,10000 --rounds 5
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from _common import cpu_time, load_1m
from torch import nn

import safepoint


def make_state(n: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.ParameterList([nn.Parameter(torch.randn(64, 64)) for _ in range(n)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in model:
        p.grad = None  # not part of any checkpoint: 0.8 GB less to hold at 50,000 parameters
    return model, opt


def torch_save(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    c0, t0 = cpu_time(), time.perf_counter()
    fn()
    return cpu_time() - c0, time.perf_counter() - t0


def thread_times() -> tuple[float, float]:
    """This thread's time on a CPU and waiting in the run queue for one, in seconds (Linux schedstat)."""
    run, queue, _ = Path("/proc/thread-self/schedstat").read_text().split()
    return int(run) / 1e9, int(queue) / 1e9


def child(args: argparse.Namespace) -> None:
    """One first save in this fresh process; prints {"cpu": s, "wall": s, "queue": s, "blocked": s}."""
    torch.set_num_threads(1)
    model, opt = make_state(args.n)
    root = Path(args.child_root)
    if args.child == "safepoint":
        state = safepoint.TrainState(model=model, optimizer=opt)

        def first() -> None:
            mgr = safepoint.CheckpointManager(root, keep=safepoint.Keep(last=1))
            mgr.save(1, state)
            first.mgr = mgr  # type: ignore[attr-defined]

        run0, queue0 = thread_times()
        cpu, wall = timed(first)
        run1, queue1 = thread_times()
        first.mgr.close()  # type: ignore[attr-defined]
    else:
        root.mkdir(parents=True, exist_ok=True)
        run0, queue0 = thread_times()
        cpu, wall = timed(lambda: torch_save(model, opt, root / "ck.pt"))
        run1, queue1 = thread_times()
    queue = queue1 - queue0
    print(json.dumps({"cpu": cpu, "wall": wall, "queue": queue, "blocked": wall - (run1 - run0) - queue}))


def first_save(n: int, what: str, root: Path, src: str | None = None) -> tuple[float, ...]:
    """(CPU, wall, run-queue wait, blocked) of a first save in a new process; ``src``: its PYTHONPATH."""
    shutil.rmtree(root, ignore_errors=True)
    cmd = [sys.executable, __file__, "--child", what, "--n", str(n), "--child-root", str(root)]
    env = None if src is None else {**os.environ, "PYTHONPATH": src}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    shutil.rmtree(root, ignore_errors=True)
    got = json.loads(out.strip().splitlines()[-1])
    return got["cpu"], got["wall"], got["queue"], got["blocked"]


def first_saves(n: int, base: Path, others: dict[str, str]) -> dict[str, Callable[[], tuple[float, ...]]]:
    """The first-save variants: safepoint (this tree), torch, and safepoint from each other source tree."""
    variants = {w: (lambda w=w: first_save(n, w, base / f"first-{w}")) for w in ("safepoint", "torch")}
    for name, src in others.items():
        variants[name] = lambda name=name, src=src: first_save(n, "safepoint", base / f"first-{name}", src)
    return variants


class Bench:
    def __init__(self, n: int, base: Path, skip: tuple[str, ...] = (), phases: tuple[str, ...] = ()) -> None:
        self.n, self.base = n, base
        self.model, self.opt = make_state(n)
        self.state = safepoint.TrainState(model=self.model, optimizer=self.opt)
        self.mgr = safepoint.CheckpointManager(base / "sp", keep=safepoint.Keep(last=1))
        self.step = 0
        # A restore needs one checkpoint; the steady save is measured once the plans are cached (from the
        # second save on). The set-up is most of a run's time at 20,000 parameters and more.
        for _ in range(2 if "steady save" in phases or not phases else 1):
            self.sp_save()
        self.plain = base / "ck.pt"
        torch_save(self.model, self.opt, self.plain)
        self.dcp_dir = base / "dcp"
        if "dcp" not in skip:
            self.dcp_save()

    def close(self) -> None:
        self.mgr.close()

    def sp_save(self) -> None:
        self.step += 1
        self.mgr.save(self.step, self.state)

    def torch_save(self) -> None:
        torch_save(self.model, self.opt, self.base / "ck-steady.pt")

    def dcp_save(self) -> None:
        shutil.rmtree(self.dcp_dir, ignore_errors=True)
        sd = {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(self.dcp_dir, sync_files=True), no_dist=True)

    def sp_restore(self) -> None:
        self.mgr.restore(self.state)

    def torch_load(self) -> None:
        sd = torch.load(self.plain, weights_only=True)
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optim"])

    def dcp_load(self) -> None:
        sd = {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
        dcp.load(sd, checkpoint_id=self.dcp_dir, no_dist=True)
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optim"])

    def phases(self, others: dict[str, str]) -> dict[str, dict[str, Callable[[], Any]]]:
        return {
            "steady save": {"safepoint": self.sp_save, "torch": self.torch_save, "dcp": self.dcp_save},
            "first save": first_saves(self.n, self.base, others),
            "restore": {"safepoint": self.sp_restore, "torch": self.torch_load, "dcp": self.dcp_load},
        }


class FirstOnly:
    """A run of the first save alone: the children build their own state, the parent none."""

    def __init__(self, n: int, base: Path) -> None:
        self.n, self.base = n, base

    def phases(self, others: dict[str, str]) -> dict[str, dict[str, Callable[[], Any]]]:
        return {"first save": first_saves(self.n, self.base, others)}

    def close(self) -> None:
        pass


def run_phase(variants: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[tuple[float, ...]]]:
    got: dict[str, list[tuple[float, ...]]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            res = variants[name]()
            got[name].append(res if isinstance(res, tuple) else (0.0, 0.0))
    return got


def print_first(got: dict[str, list[tuple[float, ...]]], row: dict[str, Any]) -> None:
    """Per round and variant: CPU, wall, run-queue wait, blocked (s); each variant's paired ratios to torch
    in CPU, wall and wall less the run-queue wait (the wall an idle machine would show)."""
    for k, v in got.items():
        cells = "  ".join(f"{c:.1f}/{w:.1f}/{q:.1f}/{b:.2f}" for c, w, q, b in v)
        print(f"    {k:12s} cpu/wall/queue/blocked s per round: {cells}", flush=True)
    for k, v in got.items():
        if k == "torch":
            continue
        pairs = list(zip(v, got["torch"], strict=True))
        for label, f in (
            ("cpu", lambda x: x[0]),
            ("wall", lambda x: x[1]),
            ("wall-queue", lambda x: x[1] - x[2]),
        ):
            ratios = [f(a) / f(b) for a, b in pairs]
            row[f"{k}_ratio_{label}"] = [round(r, 3) for r in ratios]
            mid = statistics.median(ratios)
            print(f"    {k}/torch {label:10s} median {mid:.2f} {row[f'{k}_ratio_{label}']}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", default="1000,5000,10000")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--phases", default="steady save,first save,restore")
    p.add_argument("--base", default="/dev/shm/safepoint-many-tensors")
    p.add_argument("--profile", default=None, help="a phase: profile one safepoint run of it")
    p.add_argument("--skip", default="", help="variants not run, e.g. dcp (time and /dev/shm at 50,000)")
    p.add_argument("--other", action="append", default=[], help="NAME=SRC: a first-save variant from SRC")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-root", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.n = int(args.n)
        child(args)
        return
    torch.set_num_threads(1)
    others = dict(o.split("=", 1) for o in args.other)
    rows = []
    for n in (int(x) for x in args.n.split(",")):
        base = Path(args.base) / str(n)
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        wanted = (args.profile,) if args.profile else tuple(args.phases.split(","))
        c0, t0 = cpu_time(), time.perf_counter()
        first_only = wanted == ("first save",)
        bench: Bench | FirstOnly = (
            FirstOnly(n, base) if first_only else Bench(n, base, tuple(args.skip.split(",")), wanted)
        )
        setup = cpu_time() - c0, time.perf_counter() - t0
        print(f"N={n:<6} set-up: {setup[0]:.1f} s CPU, {setup[1]:.1f} s wall  load {load_1m()}", flush=True)
        try:
            phases = bench.phases(others)
            if args.profile:
                fn = phases[args.profile]["safepoint"]
                prof = cProfile.Profile()
                prof.enable()
                fn()
                prof.disable()
                stats = pstats.Stats(prof)
                stats.sort_stats("cumulative").print_stats(45)
                stats.sort_stats("tottime").print_stats(30)
                continue
            for phase in args.phases.split(","):
                load = load_1m()
                variants = {
                    k: (lambda f=f: timed(f)) if phase != "first save" else f
                    for k, f in phases[phase].items()
                    if k not in args.skip.split(",")
                }
                got = run_phase(variants, args.rounds)
                ratios = [a[0] / b[0] for a, b in zip(got["safepoint"], got["torch"], strict=True)]
                row = {
                    "n": n,
                    "phase": phase,
                    "load": [load, load_1m()],
                    "ratio_cpu": statistics.median(ratios),
                    "ratios": [round(x, 3) for x in ratios],
                }
                for k, v in got.items():
                    row[f"{k}_us_cpu"] = statistics.median(x[0] for x in v) / n * 1e6
                    row[f"{k}_us_wall"] = statistics.median(x[1] for x in v) / n * 1e6
                    if phase == "first save":  # the wall's split: run-queue wait and blocked, seconds
                        row[f"{k}_queue_s"] = [round(x[2], 2) for x in v]
                        row[f"{k}_blocked_s"] = [round(x[3], 2) for x in v]
                rows.append(row)
                cells = "  ".join(f"{k} {row[f'{k}_us_cpu']:.0f} ({row[f'{k}_us_wall']:.0f})" for k in got)
                print(
                    f"N={n:<6} {phase:12s} µs/param cpu (wall): {cells}  | safepoint/torch cpu "
                    f"{row['ratio_cpu']:.2f} {row['ratios']}  load {row['load']}",
                    flush=True,
                )
                if phase == "first save":
                    print_first(got, row)
        finally:
            bench.close()
            shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
