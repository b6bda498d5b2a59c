"""What a content fingerprint costs (store/fingerprint.py, issues 26 and 27), against the copy it spares.

On a GPU, for one big tensor per ``--mib`` size, ``--small`` tensors of 1 KiB and ``--many`` tensors of
``--many-kib`` KiB, interleaved round by round (the order rotated each round), the median of ``--rounds``:

- ``triton``: the fused Triton kernel (store/fingerprint_triton.py), what GPU tensors use where it passes
  its probe; its digests are checked against the torch ops' and the CPU's before timing;
- ``torch-ops``: the ~40 elementwise torch ops per word (store/fingerprint.py), the fallback;
- ``pinned-copy``: the device-to-host copy into pinned buffers allocated once, one ``copy_`` per tensor
  then a synchronize: what async staging does for a tensor it does not prove unchanged.

Per case: ms, GB/s, the ratio to the pinned copy, and per tensor (us) for the many-tensor cases: the
staging policy (``staging.FINGERPRINT_CUDA_MIN_BYTES``) copies small tensors because of that per-tensor
cost. On the CPU (``--cpu``) the host rows: the torch ops, xxh3-128 (what CPU tensors use) and a copy into
a reused buffer. ``--interpret`` runs the GPU rows on the CPU through Triton's interpreter (tiny sizes
only: it checks the harness, its times mean nothing). GPU, about 20 s on an H100::

    PYTHONPATH=src python benchmarks/bench_fingerprint.py --out fp.json
    TRITON_INTERPRET=1 PYTHONPATH=src:/work/triton-site python benchmarks/bench_fingerprint.py --interpret
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import xxhash

from safepoint.store import fingerprint as fp
from safepoint.store.item_writer import tensor_bytes

Fn = Callable[[], object]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _with(sums: fp.Sums, tensors: list[torch.Tensor]) -> list[bytes]:
    """``fingerprint_tensors`` with ``sums`` computing the lane sums on every device."""
    real = fp._sums_for
    fp._sums_for = lambda device: sums
    try:
        return fp.fingerprint_tensors(tensors)
    finally:
        fp._sums_for = real


def cases(args: argparse.Namespace, device: torch.device) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(0)
    out = {
        f"one {m:g} MiB tensor": [torch.randn(int(m * 2**18), device=device, generator=g)] for m in args.mib
    }
    if args.small:
        out[f"{args.small} x 1 KiB"] = [
            torch.randn(256, device=device, generator=g) for _ in range(args.small)
        ]
    if args.many:
        n = int(args.many_kib * 256)
        out[f"{args.many} x {args.many_kib:g} KiB"] = [
            torch.randn(n, device=device, generator=g) for _ in range(args.many)
        ]
    return out


def gpu_rows(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    kernel = device.type != "cuda" or fp.fast_path(device)
    if kernel:
        from safepoint.store import fingerprint_triton as ft

        if args.interpret and not ft.INTERPRETED:
            sys.exit("--interpret needs TRITON_INTERPRET=1 set before triton is imported")
    else:
        print(
            "THE TRITON KERNEL IS NOT USED: it failed its probe (see the log above); torch ops and copy only"
        )
    rows = []
    for name, tensors in cases(args, device).items():
        nbytes = sum(t.nbytes for t in tensors)
        host = [t.cpu() for t in tensors]
        want = _with(fp._device_sums, tensors)  # the torch ops on the device
        assert _with(ft.device_sums, tensors) == want, (
            f"{name}: the Triton digests differ from the torch ops'"
        )
        if nbytes <= 16 * 2**20:  # the torch ops on the CPU read ~0.1-1 GB/s: only the small cases
            assert fp.fingerprint_tensors(host) == want, f"{name}: the GPU digests differ from the CPU's"
        pinned = [torch.empty_like(h, pin_memory=device.type == "cuda") for h in host]

        def copy(pinned: list[torch.Tensor] = pinned, tensors: list[torch.Tensor] = tensors) -> None:
            for dst, src in zip(pinned, tensors, strict=True):
                dst.copy_(src, non_blocking=True)

        variants: dict[str, Fn] = {
            "torch-ops": lambda t=tensors: _with(fp._device_sums, t),
            "pinned-copy": copy,
        }
        if kernel:
            variants["triton"] = lambda t=tensors: _with(ft.device_sums, t)
        for fn in variants.values():
            fn()  # warm-up: allocator, kernels
        times: dict[str, list[float]] = {k: [] for k in variants}
        order = list(variants)
        for r in range(args.rounds):
            for k in order[r % len(order) :] + order[: r % len(order)]:
                times[k].append(_timed(variants[k], device))
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"case": name, "tensors": len(tensors), "bytes": nbytes, "median_s": med}
        row["ratio_to_copy"] = {k: v / med["pinned-copy"] for k, v in med.items()}
        row["gb_per_s"] = {k: nbytes / v / 1e9 for k, v in med.items()}
        row["us_per_tensor"] = {k: v / len(tensors) * 1e6 for k, v in med.items()}
        rows.append(row)
        del tensors, host, pinned, variants
    return rows


def cpu_rows(args: argparse.Namespace) -> dict[str, float]:
    cpu = torch.device("cpu")
    big = torch.randn(args.cpu_mib * 2**18)
    many = [torch.randn(256) for _ in range(args.small or 2000)]
    buf = torch.empty_like(big)  # what staging does: a copy into a reused buffer
    variants: dict[str, Fn] = {
        f"torch-ops fingerprint, one {args.cpu_mib} MiB tensor": lambda: fp.fingerprint_tensor(big),
        f"torch-ops fingerprint, {len(many)} x 1 KiB": lambda: fp.fingerprint_tensors(many),
        f"xxh3-128 of the {args.cpu_mib} MiB tensor": lambda: xxhash.xxh3_128(tensor_bytes(big)).digest(),
        f"copy of the {args.cpu_mib} MiB tensor": lambda: buf.copy_(big),
    }
    return {k: min(_timed(fn, cpu) for _ in range(args.rounds)) for k, fn in variants.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, nargs="+", default=[64, 1024], help="one big tensor per size")
    p.add_argument("--small", type=int, default=2000, help="tensors of 1 KiB")
    p.add_argument("--many", type=int, default=9000, help="tensors of --many-kib KiB")
    p.add_argument("--many-kib", type=float, default=16)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--cpu", action="store_true", help="the host rows too (torch ops, xxh3, copy)")
    p.add_argument("--cpu-mib", type=int, default=16)
    p.add_argument("--interpret", action="store_true", help="the GPU rows on the CPU, Triton interpreted")
    p.add_argument("--out", help="write the results here as JSON")
    args = p.parse_args()
    if args.interpret:
        args.mib = [m for m in args.mib if m <= 0.25] or [1 / 64]
        args.small, args.many, args.many_kib, args.rounds = min(args.small, 20), min(args.many, 20), 0.25, 1
    meta: dict[str, Any] = {
        "loadavg_at_start": os.getloadavg(),
        "torch": torch.__version__,
        "args": vars(args),
    }
    out: dict[str, Any] = {"meta": meta}
    if args.cpu:
        out["cpu"] = cpu_rows(args)
        for what, s in out["cpu"].items():
            print(f"cpu: {what}: {s * 1000:.2f} ms")
    device = torch.device("cpu") if args.interpret else None
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if device is not None:
        logging.basicConfig(level=logging.INFO)  # the probe's verdict, if the kernel is not used
        meta["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreted)"
        out["gpu"] = gpu_rows(args, device)
        meta["triton"] = getattr(sys.modules.get("triton"), "__version__", None)
        for row in out["gpu"]:
            per = f", {row['tensors']} tensors" if row["tensors"] > 1 else ""
            print(f"{meta['device']}: {row['case']} ({row['bytes'] / 2**20:.1f} MiB{per})")
            for k, s in row["median_s"].items():
                print(
                    f"  {k:12s} {s * 1000:9.3f} ms  {row['gb_per_s'][k]:7.1f} GB/s  "
                    f"{row['ratio_to_copy'][k]:6.2f}x copy  {row['us_per_tensor'][k]:8.2f} us/tensor"
                )
    meta["loadavg_at_end"] = os.getloadavg()
    print(f"load average at start {meta['loadavg_at_start']}, at end {meta['loadavg_at_end']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
