#!/usr/bin/env python
"""Issue 27: where the time of an async ``save()`` goes when saves come faster than they are written.

The small state of bench_small_state.py saved at every step of a ``--step-ms`` loop with
``if_busy="auto"``. Per save path (``staged``: no save in flight; ``beside``: written synchronously
beside the one in flight; ``sync``: ``async_save=False``), the medians of: wall time, the calling thread's
CPU, the whole process's CPU (the other threads' share: the background save and retention competing with
it), the calling thread's run-queue wait (``/proc/self/task/<tid>/schedstat``: ready, no core free) and
what is left (blocked: the GIL, a lock, I/O). With the writer process, its nice value and CPU seconds.

    PYTHONPATH=src python benchmarks/profile_busy_saves.py --modes sync,process,thread --steps 40
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from bench_small_state import make, train_step

import safepoint


def _run_queue_s() -> float:
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


def run(mode: str, steps: int, step_ms: float, settle_s: float) -> None:
    model, opt, x = make()
    state = safepoint.TrainState(model=model, optimizer=opt)
    base = Path(tempfile.mkdtemp(prefix="busy-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    rec: dict[str, list[tuple[float, ...]]] = {}
    kw: dict[str, object] = {}
    if mode != "sync":
        kw = {"async_save": True, "writer": safepoint.WriterOptions(async_writer=mode, if_busy="auto")}
    try:
        with safepoint.CheckpointManager(base / "r", keep=safepoint.Keep(last=2), **kw) as mgr:  # type: ignore[arg-type]
            time.sleep(settle_s)
            for step in range(1, steps + 1):
                train_step(model, opt, x, step_ms)
                beside = mgr._writer.synced
                r0, c0, p0, w0 = _run_queue_s(), time.thread_time(), time.process_time(), time.perf_counter()
                mgr.save(step, state)
                w, c = time.perf_counter() - w0, time.thread_time() - c0
                p, q = time.process_time() - p0, _run_queue_s() - r0
                path = "sync" if mode == "sync" else ("beside" if mgr._writer.synced > beside else "staged")
                if step > 5:  # past the first saves (buffers allocated)
                    rec.setdefault(path, []).append((w, c, p, q, w - c - q))
            gate = getattr(mgr._writer, "gate", None)  # main before round 6 has none
            held = f"gate held {gate.held}, background parked {gate.parked}" if gate else "no gate"
            child = ""
            proc = getattr(mgr._process, "_proc", None)
            if proc is not None:
                fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
                cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
                child = f"; writer process nice {fields[16]}, {cpu:.2f} s CPU"
            print(f"{mode}: {held}{child}")
        for path, v in rec.items():
            med = [statistics.median(x[i] for x in v) * 1e3 for i in range(5)]
            print(
                f"  {mode:7s} {path:6s} n={len(v):3d} wall {med[0]:5.1f} thread CPU {med[1]:5.1f} "
                f"process CPU {med[2]:5.1f} run queue {med[3]:5.1f} blocked {med[4]:5.1f} ms",
                flush=True,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="sync,process,thread")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--settle-s", type=float, default=0.0, help="sleep after opening the manager")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"load {os.getloadavg()[0]:.2f}")
    for mode in args.modes.split(","):
        run(mode, args.steps, args.step_ms, args.settle_s)
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
