"""What a content fingerprint costs (store/fingerprint.py, issue 26), against the host hash and the copy it
spares. Per device: the torch-ops fingerprint of one big tensor and of many small ones; on the CPU also
xxh3-128 of the bytes (what incremental saves use for CPU tensors) and a plain copy; on CUDA the
device-to-host copy into pinned memory that an unchanged tensor no longer needs. Best of ``--repeat`` (a
loaded machine adds noise, never speed).

    PYTHONPATH=src python benchmarks/bench_fingerprint.py --mib 64
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import xxhash

from safepoint.store.fingerprint import fingerprint_tensor, fingerprint_tensors
from safepoint.store.item_writer import tensor_bytes


def _time(fn: Callable[[], object], repeat: int, cuda: bool) -> float:
    times = []
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


def run(device: str, mib: int, small: int, repeat: int) -> None:
    cuda = device == "cuda"
    big = torch.randn(mib * 2**20 // 4, device=device)
    many = [torch.randn(256, device=device) for _ in range(small)]
    fingerprint_tensor(big), fingerprint_tensors(many)  # warm-up
    gib = big.nbytes / 2**30
    rows = {
        f"fingerprint, one {mib} MiB tensor": _time(lambda: fingerprint_tensor(big), repeat, cuda),
        f"fingerprint, {small} tensors of 1 KiB": _time(lambda: fingerprint_tensors(many), repeat, cuda),
    }
    if cuda:
        pinned = torch.empty(big.shape, dtype=big.dtype, pin_memory=True)
        rows[f"D2H copy of the {mib} MiB tensor (pinned)"] = _time(
            lambda: pinned.copy_(big, non_blocking=True), repeat, cuda
        )
    else:
        rows[f"xxh3-128 of the {mib} MiB tensor"] = _time(
            lambda: xxhash.xxh3_128(tensor_bytes(big)).digest(), repeat, cuda
        )
        buf = torch.empty_like(big)  # what staging does: a copy into a reused buffer
        rows[f"copy of the {mib} MiB tensor"] = _time(lambda: buf.copy_(big), repeat, cuda)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{device} ({name}), load average {os.getloadavg()[0]:.1f}")
    for what, s in rows.items():
        per = f"  ({s / gib * 1000:.1f} ms/GiB)" if "one" in what or "copy" in what or "xxh3" in what else ""
        print(f"  {what}: {s * 1000:.2f} ms{per}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--small", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--cpu-mib", type=int, default=16, help="the CPU's big tensor (the torch ops are slow)")
    args = p.parse_args()
    run("cpu", args.cpu_mib, args.small, args.repeat)
    if torch.cuda.is_available():
        run("cuda", args.mib, args.small, args.repeat)


if __name__ == "__main__":
    main()
