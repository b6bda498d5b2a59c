"""Async staging of wrapper tensors (torchao's NF4 kind): what a frozen quantized base costs the loop a save.

Per round, interleaved: the process CPU time of ``Stager.stage`` (the blocking copy of an async save) over N
NF4 tensors, steady (buffers reused), against the very same inner tensors staged as plain tensors (what the
bytes alone cost: the difference is the per-wrapper work of save/wrappers.py, its flatten, signature, the
mirrored attributes). Both with the thread writer's private buffers and the process writer's segment.

    PYTHONPATH=src:. python benchmarks/bench_wrapper_staging.py --tensors 200 --side 256 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

from safepoint.save.staging import Stager
from safepoint.save.wrappers import inner_tensors


def _per_save(stager: Stager, sd: dict[str, Any], saves: int, bump: list[torch.Tensor]) -> float:
    spent = 0.0
    for _ in range(saves):
        for x in bump:  # written since the last save, as a training step would: copied, not fingerprinted
            x.add_(0)
        t = time.process_time()
        stager.stage(dict(sd))
        spent += time.process_time() - t
    return spent / saves


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tensors", type=int, default=200)
    p.add_argument("--side", type=int, default=256, help="each weight is side x side bf16 before quantizing")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--saves", type=int, default=20, help="saves per round")
    args = p.parse_args()
    torch.manual_seed(0)
    nf4 = {
        f"w{i}": to_nf4(torch.randn(args.side, args.side, dtype=torch.bfloat16)) for i in range(args.tensors)
    }
    plain = {
        f"w{i}.{j}": t.clone() for i, w in enumerate(nf4.values()) for j, t in enumerate(inner_tensors(w))
    }
    for shared in (False, True):
        stagers = {"nf4": Stager(shared=shared), "plain": Stager(shared=shared)}
        states = {"nf4": nf4, "plain": plain}
        bumps: dict[str, list[torch.Tensor]] = {"nf4": [], "plain": list(plain.values())}
        for name, s in stagers.items():
            s.stage(dict(states[name]))  # the first save allocates
        times: dict[str, list[float]] = {"nf4": [], "plain": []}
        for _ in range(args.rounds):
            for name, s in stagers.items():
                times[name].append(_per_save(s, states[name], args.saves, bumps[name]))
        ms = {name: statistics.median(v) * 1e3 for name, v in times.items()}
        extra_us = (ms["nf4"] - ms["plain"]) * 1e3 / args.tensors
        row = {
            "writer": "process segment" if shared else "thread buffers",
            "nf4_ms": round(ms["nf4"], 2),
            "plain_inner_ms": round(ms["plain"], 2),
            "extra_us_per_wrapper": round(extra_us, 1),
            "allocations": {name: s.allocations for name, s in stagers.items()},
        }
        print(json.dumps(row))
        for s in stagers.values():
            s.release()


if __name__ == "__main__":
    main()
