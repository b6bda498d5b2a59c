"""Imports torch + safepoint once, then forks one training child per request.

Forking from this single-threaded process is safe (unlike forking pytest, whose torch threads can leave
locks held in the child), and saves the ~1-2 s import per kill in long SIGKILL campaigns.
Protocol on stdin: "RUN <root> <start> [async]"; on stdout: "PID <pid>", the child's BEGIN/END lines, "EXIT <status>".
"""

from __future__ import annotations

import os
import sys

import torch  # imported before forking on purpose

# torch.optim imports torch._dynamo on the first optimizer built (~1.6 s here, no thread started): without
# this every forked child paid it again, and 200 kills took longer than the test's time limit.
import torch._dynamo  # noqa: F401

import safepoint  # noqa: F401
from tests.helpers.procs import saver_child


def main() -> None:
    for line in sys.stdin:
        cmd, root, start, *mode = line.split()
        assert cmd == "RUN"
        sys.stdout.flush()
        # The child waits until its pid is announced: its own BEGIN line must never come first (the
        # parent would read it as the pid line and SIGKILL the wrong process; seen once under load).
        gate_r, gate_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(gate_w)
            os.read(gate_r, 1)
            os.close(gate_r)
            sys.argv = ["saver_child", root, start, *mode]
            try:
                saver_child.main()
            finally:
                os._exit(0)
        os.close(gate_r)
        print(f"PID {pid}", flush=True)
        os.close(gate_w)
        _, status = os.waitpid(pid, 0)
        print(f"EXIT {status}", flush=True)


if __name__ == "__main__":
    main()
