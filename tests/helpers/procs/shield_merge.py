"""A rank whose shielded worker has a foreign SIGTERM and its parent's exit SIGTERM pending at once, for
tests/preempt/test_preemption_loader.py.

SIGTERM does not queue: while the group's SIGTERM (from torchrun's agent) is still pending in a worker,
the ``terminate()`` of multiprocessing's exit handler merges into it, and the worker's waiter thread then
reads only the first sender. Under load that thread may not run for long enough; here it is started only
once both have been sent, so the merge happens every time. Sequenced by pipes:

1. the worker blocks every signal (a superset of what the shield blocks) and prints its pid;
2. the test sends it SIGTERM (a foreign sender); the worker sees it pending and tells the rank;
3. the rank closes its shield and returns: its exit handler stops the worker (``terminate()``, which
   tells the worker through a pipe) and joins it;
4. only then does the worker shield itself, starting the waiter. The rank exits 0 once the worker is gone.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from multiprocessing import popen_fork
from pathlib import Path

from safepoint.preempt import shield

PENDING_R, PENDING_W = os.pipe()  # worker -> rank: the foreign SIGTERM is pending
TERMINATED_R, TERMINATED_W = os.pipe()  # rank's exit handler -> worker: terminate() has signalled you


class _Popen(popen_fork.Popen):
    def terminate(self) -> None:
        super().terminate()  # the SIGTERM from the parent, sent by multiprocessing's exit handler
        os.write(TERMINATED_W, b"t")


class Worker(multiprocessing.get_context("fork").Process):  # type: ignore[misc]
    @staticmethod
    def _Popen(process_obj: multiprocessing.process.BaseProcess) -> _Popen:
        return _Popen(process_obj)


def _pending(sig: signal.Signals) -> bool:
    status = Path("/proc/self/status").read_text().splitlines()
    masks = [int(line.split()[1], 16) for line in status if line.startswith(("ShdPnd:", "SigPnd:"))]
    return any(m & (1 << (sig - 1)) for m in masks)


def worker() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    print(os.getpid(), flush=True)
    while not _pending(signal.SIGTERM):  # waits for the test's signal, whenever it comes
        threading.Event().wait(0.01)
    os.write(PENDING_W, b"p")
    assert os.read(TERMINATED_R, 1) == b"t"
    shield.shield({signal.SIGTERM})
    threading.Event().wait()  # only the shield's waiter ends this process


def main() -> None:
    token = shield.activate({signal.SIGTERM})
    w = Worker(target=worker, daemon=True)  # daemonic, as DataLoader workers are
    w.start()
    os.close(PENDING_W)
    if os.read(PENDING_R, 1) != b"p":
        sys.exit("the worker died before its SIGTERM was pending")
    shield.deactivate(token)  # as the manager's exit does: the workers still running must go at exit
    print("rank exiting", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
