"""Measures peak extra host memory of async saves, in a fresh process.

Prints JSON: state bytes, RSS before, peak RSS, RSS after each block of saves, staging allocations.
"""

from __future__ import annotations

import json
import resource
import sys

import psutil
import torch

import safepoint


def peak_rss() -> int:
    """This process's own peak RSS. Not ru_maxrss: Linux carries it across fork+exec, so a child of a big
    pytest process would report the parent's peak (VmHWM belongs to the new address space)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    root, saves, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    n = mib * 1024 * 1024 // 4 // 4
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n)) for _ in range(4)])
    model = torch.nn.Module()
    model.params = params
    state = safepoint.TrainState(model=model, rng=False)
    state_bytes = sum(p.numel() * 4 for p in params)
    proc = psutil.Process()
    with safepoint.CheckpointManager(root, async_save=True, keep_last=1) as mgr:
        # One warm-up save so allocator pools and lazy imports are part of the baseline, not the "extra".
        mgr.save(0, state)
        mgr.wait()
        base_rss = proc.memory_info().rss
        base_peak = peak_rss()
        rss_after: list[int] = []
        for step in range(1, saves + 1):
            with torch.no_grad():
                for p in params:
                    p.add_(1.0)
            mgr.save(step, state)
            if step % 10 == 0:
                rss_after.append(proc.memory_info().rss)
        mgr.wait()
        allocations = mgr._stager.allocations  # the test checks the reuse it promises
    peak = peak_rss()
    print(
        json.dumps(
            {
                "state_bytes": state_bytes,
                "base_rss": base_rss,
                "base_peak": base_peak,
                "peak": peak,
                "rss_after": rss_after,
                "allocations": allocations,
            }
        )
    )


if __name__ == "__main__":
    main()
