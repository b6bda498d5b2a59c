#!/usr/bin/env python
"""Issue 27: a small state (a 3-layer MLP + AdamW, ~1.6 MB) saved often.

1. Steady sync save: ``CheckpointManager.save`` (after 2 warm-up saves) against ``torch.save`` + fsync of
   the same model and optimizer state, interleaved, CPU time (process + children) and wall, per save.
2. Saving every step of a training loop of ``--step-ms`` (forward, backward, AdamW step, then busy work up
   to the step time): how long the call blocks the loop, sync against async, for each ``--writers``, with
   ``--call maybe_save`` (``save_every_steps=1``) or ``--call save``; the async runs use
   ``WriterOptions(if_busy=--if-busy)`` ("auto" here: a save that finds the previous one still writing is
   written synchronously beside it; "wait" waits for it; "skip" skips it). Each run prints how many saves
   went beside the one in flight and how many waited for it.

    python benchmarks/bench_small_state.py --saves 30 --steps 60 --step-ms 20
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import cpu_time, load_1m
from torch import nn

import safepoint


def make() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 128)
    model(x).sum().backward()
    opt.step()
    return model, opt, x


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, step_ms: float) -> None:
    """One optimizer step, then a busy wait to ``step_ms`` in all (as a GPU step keeps the loop busy)."""
    t0 = time.perf_counter()
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    while time.perf_counter() - t0 < step_ms / 1e3:
        pass


def steady(base: Path, saves: int, drain: bool = False) -> None:
    model, opt, _ = make()
    state = safepoint.TrainState(model=model, optimizer=opt)
    path = base / "ck.pt"

    def torch_save() -> None:
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    got: dict[str, list[tuple[float, float]]] = {"safepoint": [], "torch": []}
    load = load_1m()
    with safepoint.CheckpointManager(base / "sync", keep=safepoint.Keep(last=1)) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        for i in range(saves):
            order = ["safepoint", "torch"] if i % 2 == 0 else ["torch", "safepoint"]
            for name in order:
                c0, t0 = cpu_time(), time.perf_counter()
                if name == "torch":
                    torch_save()
                else:
                    mgr.save(3 + i, state)
                    if drain:  # the retention pass (its own thread) counted with this save, not the next
                        mgr.wait()
                got[name].append((cpu_time() - c0, time.perf_counter() - t0))
    ratios = [a[0] / b[0] for a, b in zip(got["safepoint"], got["torch"], strict=True)]
    walls = [a[1] / b[1] for a, b in zip(got["safepoint"], got["torch"], strict=True)]
    cells = "  ".join(
        f"{k} cpu {statistics.median(c for c, _ in v) * 1e3:.1f} ms "
        f"wall {statistics.median(w for _, w in v) * 1e3:.1f} ms"
        for k, v in got.items()
    )
    print(
        f"steady sync save: {cells} | safepoint/torch cpu {statistics.median(ratios):.2f} "
        f"wall {statistics.median(walls):.2f}  load {load}->{load_1m()}",
        flush=True,
    )


def loop(
    base: Path, mode: str, steps: int, step_ms: float, call: str, if_busy: str = "auto"
) -> tuple[list[float], int]:
    model, opt, x = make()
    state = safepoint.TrainState(model=model, optimizer=opt)
    async_save = mode != "sync"
    writer = (
        safepoint.WriterOptions(async_writer=mode, if_busy=if_busy)
        if async_save
        else safepoint.WriterOptions()
    )
    blocked: list[float] = []
    root = base / f"loop-{mode}"
    every = 1 if call == "maybe_save" else None
    skipped = 0
    with safepoint.CheckpointManager(
        root, keep=safepoint.Keep(last=2), async_save=async_save, writer=writer, save_every_steps=every
    ) as mgr:
        for step in range(1, steps + 1):
            train_step(model, opt, x, step_ms)
            s0 = time.perf_counter()
            if call == "maybe_save":
                skipped += 0 if mgr.maybe_save(step, state) else 1
            else:
                mgr.save(step, state)
            blocked.append(time.perf_counter() - s0)
        # if_busy="auto": written beside the write in flight; "wait": waited for it
        synced, waited = (mgr._writer.synced, mgr._writer.waited) if async_save else (0, 0)
    shutil.rmtree(root, ignore_errors=True)
    print(
        f"  {mode} {call}(): of {steps} saves {synced} written synchronously beside the one in flight, "
        f"{waited} waited for it"
    )
    return blocked[5:], skipped  # past the first saves (the writer process starting, buffers allocated)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--saves", type=int, default=30)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--writers", default="sync,thread,auto")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--call", default="maybe_save,save", help="maybe_save (save_every_steps=1) and/or save")
    p.add_argument("--if-busy", default="auto", help="WriterOptions(if_busy=) of the async runs")
    p.add_argument(
        "--drain",
        action="store_true",
        help="wait for each save's retention pass inside its timing (else its CPU lands in whichever "
        "measurement runs next: half the time torch.save's)",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    base = Path(
        tempfile.mkdtemp(prefix="bench-small-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    try:
        if args.saves:
            steady(base, args.saves, args.drain)
        for r in range(args.rounds):
            for call in args.call.split(","):
                for mode in args.writers.split(","):
                    load = load_1m()
                    b, skipped = loop(base, mode, args.steps, args.step_ms, call, args.if_busy)
                    print(
                        f"round {r} every step of a {args.step_ms:.0f} ms loop, {mode:6s} {call}(): blocks "
                        f"median {statistics.median(b) * 1e3:.1f} ms, p90 "
                        f"{sorted(b)[int(len(b) * 0.9)] * 1e3:.1f} ms, max {max(b) * 1e3:.1f} ms, "
                        f"{skipped} of {args.steps} skipped  load {load}->{load_1m()}",
                        flush=True,
                    )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
