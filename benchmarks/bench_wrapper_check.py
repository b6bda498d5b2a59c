"""The save-time check of wrapper tensors (torchao's NF4 kind): a frozen quantized base saved step after step.

Per round, interleaved: the CPU time and the peak traced host memory of ``restorable`` (what every save runs
on the captured state) over N wrapper tensors, once with the verdicts cached (data/restorable.py
``_WrapperVerdicts``: only the pickled structure of each tensor) and once by the real rule on every tensor
(the whole tensor through torch.save and a weights_only load, in memory: what every save did before).
torchao's NF4Tensor where torchao is importable (``--nf4``), else the tests' WrapperTensor.

    PYTHONPATH=src:. python benchmarks/bench_wrapper_check.py --tensors 16 --mib 16 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import time
import tracemalloc
from typing import Any

import torch

from safepoint.data import restorable as r


def _state(n: int, mib: int, nf4: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    if nf4:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        side = int((mib * 2**20 * 2) ** 0.5) // 64 * 64  # NF4 packs two values a byte
        return {f"w{i}": to_nf4(torch.randn(side, side, dtype=torch.bfloat16)) for i in range(n)}
    from tests.helpers.wrapper_tensor import WrapperTensor

    torch.serialization.add_safe_globals([WrapperTensor])
    return {f"w{i}": WrapperTensor(torch.randn(mib * 2**18), {"block": 64, "i": i}) for i in range(n)}


def _measure(fn: Any) -> tuple[float, int]:
    tracemalloc.start()
    t = time.process_time()
    fn()
    cpu = time.process_time() - t
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return cpu, peak


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--mib", type=int, default=16, help="bytes of each tensor's data, MiB")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--nf4", action="store_true", help="torchao's NF4Tensor (torchao must be importable)")
    args = p.parse_args()
    sd = _state(args.tensors, args.mib, args.nf4)
    r.restorable(sd)  # the first save: the real rule once per structure (both variants pay it)
    rows = []
    for _ in range(args.rounds):
        cached = _measure(lambda: r.restorable(sd))
        every = _measure(lambda: [r._check_weights_only(v, k) for k, v in sd.items()])
        rows.append({"cached_cpu_s": cached[0], "cached_peak_b": cached[1], "every_cpu_s": every[0],
                     "every_peak_b": every[1]})  # fmt: skip
    med = {k: sorted(row[k] for row in rows)[len(rows) // 2] for k in rows[0]}
    ratio = med["every_cpu_s"] / max(med["cached_cpu_s"], 1e-9)
    out = {"args": vars(args), "load": os.getloadavg()[0], "median": med, "cpu_ratio_every_vs_cached": ratio}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
