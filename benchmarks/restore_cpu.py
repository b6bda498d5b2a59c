"""CPU time of one verified safepoint restore against ``torch.load`` + ``load_state_dict`` of the same state.

The many-small-tensors state of bench_peers.py (LAYERS x ``Linear(132, 132)`` + Adam), saved once by each,
then restored alternately REPS times in this one process; prints the CPU seconds of each and their ratio.
CPU time rather than wall time: on a shared machine it is the steadier of the two. ``--profile`` adds a
cProfile of one more safepoint restore (cumulative and own time, top 40).

    python benchmarks/restore_cpu.py --layers 1250 --reps 4 [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import time
from pathlib import Path

import torch
from _common import linear_adam

import safepoint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=1250)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--base", default="/dev/shm/safepoint-restore-cpu")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    model, opt = linear_adam(args.layers)
    base = Path(args.base)
    shutil.rmtree(base, ignore_errors=True)
    state = safepoint.TrainState(model=model, optimizer=opt)
    mgr = safepoint.CheckpointManager(base / "sp", keep=safepoint.Keep(last=1))
    mgr.save(1, state)
    plain = base / "ck.pt"
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, plain)

    def torch_load() -> None:
        sd = torch.load(plain, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    try:
        for _ in range(args.reps):
            t = time.process_time()
            mgr.restore(state)
            ours = time.process_time() - t
            t = time.process_time()
            torch_load()
            theirs = time.process_time() - t
            ratio = ours / theirs
            print(f"cpu s: safepoint {ours:.3f}  torch.load {theirs:.3f}  ratio {ratio:.2f}", flush=True)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            mgr.restore(state)
            prof.disable()
            stats = pstats.Stats(prof)
            stats.sort_stats("cumulative").print_stats(40)
            stats.sort_stats("tottime").print_stats(40)
    finally:
        mgr.close()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
