"""What preemption costs a training loop: maybe_save with and without notice sources (run by hand).

    python tests/dist_preempt/cost.py ROOT                                        # one process
    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/dist_preempt/cost.py ROOT

No save policy is configured, so maybe_save does nothing but the preemption check: the difference between
the two timings is the whole per-step cost. Also reports one bare comm.any() (what a check on every step
would cost). Numbers are quoted in docs/preemption.md.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time

import torch.distributed as dist

import safepoint
from safepoint.dist import Comm


def per_call(fn: object, n: int) -> float:
    assert callable(fn)
    for i in range(100):
        fn(i)
    t0 = time.perf_counter()
    for i in range(100, 100 + n):
        fn(i)
    return (time.perf_counter() - t0) / n


def main() -> None:
    root = sys.argv[1]
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        safepoint.init_process_group("gloo", timeout_s=60)
    rank = dist.get_rank() if distributed else 0
    state = safepoint.TrainState(extra={"x": 0})
    n = 200_000
    flag = os.path.join(tempfile.gettempdir(), f"safepoint-cost-{os.getpid()}")
    results: dict[str, tuple[float, int]] = {}
    for name, kw in [
        ("no notice source", {}),
        ("signals", {"preemption": safepoint.PreemptionOptions(signals=(signal.SIGTERM, signal.SIGUSR1))}),
        ("signals + file", {"preemption": safepoint.PreemptionOptions(signals=(signal.SIGTERM,), file=flag)}),
    ]:
        with safepoint.CheckpointManager(f"{root}/{len(results)}", **kw) as mgr:  # type: ignore[arg-type]
            # A tight loop: the agreement measures microsecond steps and checks rarely, so this is the
            # per-call cost of the local part (sources' check(), the agreement's step arithmetic).
            t = per_call(lambda i, mgr=mgr: mgr.maybe_save(i, state), n)
            checks = mgr._preemption.agreement.checks if mgr._preemption else 0
            results[name] = (t, checks)
    comm = Comm(30.0)
    t_any = per_call(lambda i: comm.any(False), 2000)
    comm.destroy()
    if rank == 0:
        base = results["no notice source"][0]
        ws = dist.get_world_size() if distributed else 1
        print(f"world size {ws}: maybe_save, no save policy, tight loop of {n} calls")
        for name, (t, checks) in results.items():
            print(f"  {name:18s} {t * 1e6:8.2f} us/call  (+{(t - base) * 1e6:5.2f} us; {checks} checks)")
        print(f"  one comm.any():    {t_any * 1e6:8.1f} us")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
