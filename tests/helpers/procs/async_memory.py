"""Measures peak extra host memory of async saves, in a fresh process.

Prints JSON: state bytes, RSS before, peak RSS, RSS after each block of saves, staging allocations; with
the process writer also the writer process's private (anonymous) memory after the warm-up save and its
peak while the saves run, sampled every few milliseconds: the staged state it reads is shared, not copied.
"""

from __future__ import annotations

import json
import resource
import sys
import threading
import time

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


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")


class AnonSampler:
    """Peak RssAnon of another process, polled on a thread (its VmHWM would count the shared pages too)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon(self.pid))
            time.sleep(0.002)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


def main() -> None:
    root, saves, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    writer = sys.argv[4] if len(sys.argv) > 4 else "thread"
    n = mib * 1024 * 1024 // 4 // 4
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n)) for _ in range(4)])
    model = torch.nn.Module()
    model.params = params
    state = safepoint.TrainState(model=model, rng=False)
    state_bytes = sum(p.numel() * 4 for p in params)
    proc = psutil.Process()
    child: dict[str, int] = {}
    with safepoint.CheckpointManager(
        root,
        async_save=True,
        writer=safepoint.WriterOptions(async_writer=writer),
        keep=safepoint.Keep(last=1),
    ) as mgr:
        if mgr._process is not None:
            mgr._process.wait_ready()  # saves before it is ready are the thread's: measure the process's
        # One warm-up save so allocator pools and lazy imports are part of the baseline, not the "extra".
        mgr.save(0, state)
        mgr.wait()
        base_rss = proc.memory_info().rss
        base_peak = peak_rss()
        sampler = None
        if mgr._process is not None:
            assert mgr._process.pid is not None
            child["pid"] = mgr._process.pid
            child["anon_base"] = rss_anon(mgr._process.pid)
            sampler = AnonSampler(mgr._process.pid)
        rss_after: list[int] = []
        for step in range(1, saves + 1):
            with torch.no_grad():
                for p in params:
                    p.add_(1.0)
            mgr.save(step, state)
            if step % 10 == 0:
                rss_after.append(proc.memory_info().rss)
        mgr.wait()
        if sampler is not None:
            child["anon_peak"] = sampler.stop()
            child["started"] = mgr._process.started if mgr._process else 0
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
                "child": child,
            }
        )
    )


if __name__ == "__main__":
    main()
