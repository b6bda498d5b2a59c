"""Measures peak extra host memory of async saves: run as a fresh process so ru_maxrss is meaningful.

Prints JSON: state bytes, RSS before, peak RSS, RSS after each block of saves, staging allocations.
"""

from __future__ import annotations

import json
import resource
import sys

import psutil
import torch

import safepoint


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
        base_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
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
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
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
