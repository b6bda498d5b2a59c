#!/usr/bin/env python
"""Where ``WriterOptions(async_writer="auto")`` starts the writer process (save/writer_choice.py).

What the writer process takes off the training process is the GIL time of the write: DCP's per-item work
(a ``torch.save`` per tensor, the plan's entries, the write results). Planning, ``.metadata``, the commit
and the hand-off to the process stay in the rank's writer thread, and the process has a CPU of its own to
find. So for each state size: an MLP of ``Linear(--width, --width)`` layers with Adam (8 tensor items per
layer: weight, bias, two moments each, a step each), every tensor written to before each save (all copied
and written, none proven unchanged), async saves with the thread writer and with a writer process (ready),
interleaved, one at a time. While each save's write runs, the calling thread runs a Python-bound loop
(``probe``: tiny tensor ops, dispatch under the GIL, like a small model's training step); once the write is
done, it runs the same number of iterations again. ``lost`` = the first run's time minus the second's:
what the background write cost that loop (the GIL, and the CPU where no core is idle). ``write``: how long
the write ran; ``child CPU``: the writer process's CPU for it (/proc/<pid>/stat).

    python benchmarks/bench_auto_writer.py --layers 16,64,128,256 --saves 6
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
from torch import nn

import safepoint

TICK = os.sysconf("SC_CLK_TCK")


def child_cpu(pid: int | None) -> float:
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def state(layers: int, width: int) -> tuple[nn.Module, torch.optim.Optimizer, safepoint.TrainState]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt, safepoint.TrainState(model=model, optimizer=opt, rng=False)


def touch(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Every tensor of the state written to, as by a training step: each save copies and writes all of
    them (none proven unchanged by a fingerprint), without the step's own CPU in the figures."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        for s in opt.state.values():
            for t in s.values():
                t.add_(1.0)


_Y = torch.zeros(16)


def probe() -> None:
    """A slice of a Python-bound training loop: 200 tiny tensor ops (dispatch under the GIL, no bytes)."""
    y = _Y
    for _ in range(200):
        y = torch.add(y, 1.0)


def one(layers: int, width: int, saves: int, base: Path) -> dict[str, list[float]]:
    model, opt, st = state(layers, width)
    out: dict[str, list[float]] = {}
    mgrs = {}
    for writer in ("thread", "process"):
        options = safepoint.WriterOptions(async_writer=writer, if_busy="wait", incremental=False)
        mgrs[writer] = safepoint.CheckpointManager(
            base / f"{writer}-{layers}", async_save=True, writer=options, keep=safepoint.Keep(last=1)
        )
    try:
        proc = mgrs["process"]._process
        assert proc is not None
        proc.wait_ready()
        for step in range(1, saves + 3):
            for writer in ("thread", "process") if step % 2 else ("process", "thread"):
                mgr = mgrs[writer]
                touch(model, opt)
                pid = proc.pid if writer == "process" else None
                k0 = child_cpu(pid)
                mgr.save(step, st)
                t1 = time.perf_counter()  # staged: the write runs from here
                n = 0
                while mgr._writer.busy:  # the loop's Python-bound work while the write runs
                    probe()
                    n += 1
                t2 = time.perf_counter()
                k1 = child_cpu(pid)
                mgr.wait()
                t3 = time.perf_counter()
                for _ in range(n):  # the same work again, nothing in flight
                    probe()
                t4 = time.perf_counter()
                if step > 2:  # the first two: buffers made, the process's first description
                    out.setdefault(f"{writer} write", []).append(t2 - t1)
                    out.setdefault(f"{writer} child", []).append(k1 - k0)
                    out.setdefault(f"{writer} lost", []).append((t2 - t1) - (t4 - t3))
        assert proc.writes >= saves, "the process did not write the measured saves"
    finally:
        for mgr in mgrs.values():
            mgr.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="16,64,128,256", help="MLP depths (8 tensor items per layer)")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--saves", type=int, default=5, help="measured saves per writer and depth")
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    a = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="safepoint-bench-auto-", dir=a.dir))
    print(f"load average at start {os.getloadavg()}")
    print("items | MiB | lost: thread / process (ms) | write: thread / process (ms) | child CPU (ms) | load")
    print("--:|--:|--:|--:|--:|--:")
    try:
        for layers in (int(x) for x in a.layers.split(",")):
            r = one(layers, a.width, a.saves, base)
            med = {k: statistics.median(v) * 1e3 for k, v in r.items()}
            items, mib = layers * 8, layers * 3 * 4 * a.width * (a.width + 1) / 2**20
            print(
                f"{items} | {mib:.0f} | {med['thread lost']:.0f} / {med['process lost']:.0f} | "
                f"{med['thread write']:.0f} / {med['process write']:.0f} | {med['process child']:.0f} | "
                f"{os.getloadavg()[0]:.1f}",
                flush=True,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
