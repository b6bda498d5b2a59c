"""CPU seconds of async saves of many small tensors: the rank's process and its writer process, per save.

The many-small-tensors state of bench_peers.py (LAYERS x ``Linear(132, 132)`` + Adam). One manager, its
writer process ready, one untimed save, then SAVES saves of the unchanged state, each waited for; prints
one JSON line: per save the rank's CPU (``time.process_time``, every thread), the writer process's CPU
(from ``/proc/PID/stat``), the wall time to durable and the blocking part. ``--writer thread`` or ``sync``
for the same figures without a process. CPU time rather than wall time: on a shared machine it is the
steadier of the two. Alternate runs of two source trees with PYTHONPATH to compare them:

    PYTHONPATH=src python benchmarks/async_cpu.py --layers 625 --saves 4 [--writer process|thread|sync]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import torch
from _common import linear_adam

import safepoint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=625)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--writer", choices=("process", "thread", "sync"), default="process")
    p.add_argument("--base", default="/dev/shm/safepoint-async-cpu")
    args = p.parse_args()
    torch.set_num_threads(1)
    model, opt = linear_adam(args.layers)
    state = safepoint.TrainState(model=model, optimizer=opt)
    root = f"{args.base}-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    options: dict[str, object] = {}
    if args.writer != "sync":
        options = {"async_save": True, "writer": safepoint.WriterOptions(async_writer=args.writer)}
    mgr = safepoint.CheckpointManager(root, keep=safepoint.Keep(last=1), **options)  # type: ignore[arg-type]
    process = getattr(mgr, "_process", None)
    if process is not None:
        process.wait_ready()

    def writer_cpu() -> float:
        if process is None:
            return 0.0
        with open(f"/proc/{process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    runs = []
    try:
        for step in range(args.saves + 1):  # step 0: untimed (buffers, plan, the process's first save)
            c0, w0, t0 = time.process_time(), writer_cpu(), time.perf_counter()
            mgr.save(step, state)
            blocking = time.perf_counter() - t0
            mgr.wait()
            if step:
                rank, writer = time.process_time() - c0, writer_cpu() - w0
                runs.append((rank, writer, time.perf_counter() - t0, blocking))
    finally:
        mgr.close()
        shutil.rmtree(root, ignore_errors=True)
    print(
        json.dumps(
            {
                "writer": args.writer,
                "rank_cpu": [round(r[0], 3) for r in runs],
                "writer_cpu": [round(r[1], 3) for r in runs],
                "wall": [round(r[2], 3) for r in runs],
                "blocking": [round(r[3], 3) for r in runs],
                "loadavg_1m": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
