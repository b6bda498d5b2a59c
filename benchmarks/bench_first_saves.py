#!/usr/bin/env python
"""Issue 14 item 5: what the first async saves of a fresh manager cost the training loop.

The loop of the issue, in one process: 8 x Linear(256, 256) + AdamW, ``save_every_steps=25``,
``async_save=True``, a fresh ``CheckpointManager`` per run (so its writer process starts with it), and the
wall time of every step including its ``maybe_save``. Reported per save: the loop-visible cost, i.e. the
step that saved minus the median of its 10 neighbours (5 before, 5 after), next to the bare staging copy
(the manager's own ``stage_s``). Variants (``--writers``) interleaved per run: "process" (started with the
manager; "auto" starts one at the first save of a state of 500 tensors or more, and writes this 32-tensor
state with the thread) and "thread".

    python benchmarks/bench_first_saves.py --runs 5 --steps 110
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import safepoint


def one_run(root: Path, writer: str, steps: int, every: int) -> tuple[list[float], list[tuple[int, float]]]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256)
    state = safepoint.TrainState(model=model, optimizer=opt)
    times: list[float] = []
    with safepoint.CheckpointManager(
        root,
        save_every_steps=every,
        async_save=True,
        writer=safepoint.WriterOptions(async_writer=writer),
    ) as mgr:
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mgr.maybe_save(step, state)
            times.append(time.perf_counter() - t0)
        stages = [(s.step, s.blocking_s) for s in mgr.saves]
    return times, stages


def gaps(times: list[float], every: int) -> list[tuple[int, float]]:
    out = []
    for step in range(every, len(times) - 5, every):
        i = step - 1
        neighbours = times[i - 5 : i] + times[i + 1 : i + 6]
        out.append((step, times[i] - statistics.median(neighbours)))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=110)
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--writers", default="process,thread")
    a = p.parse_args()
    torch.set_num_threads(1)
    base = Path(tempfile.mkdtemp(prefix="bench-first-saves-"))
    try:
        for run in range(a.runs):
            for writer in a.writers.split(","):
                root = base / f"{writer}-{run}"
                times, stages = one_run(root, writer, a.steps, a.every)
                shutil.rmtree(root)
                cost = " ".join(f"{s}:{g * 1e3:+.0f}ms" for s, g in gaps(times, a.every))
                stage = " ".join(f"{s}:{b * 1e3:.0f}ms" for s, b in stages)
                print(
                    f"run {run} {writer:6s} step median {statistics.median(times) * 1e3:.1f} ms, "
                    f"max {max(times) * 1e3:.0f} ms | save step: loop-visible cost {cost} | stage {stage}",
                    flush=True,
                )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
