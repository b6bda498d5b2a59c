"""A clean process that imports torch and safepoint once, then forks one child per request.

Forking from this single-threaded process is cheap and safe (forking pytest, whose torch threads can hold
locks, is not). Protocol: one JSON command per line on stdin (see scenarios.run_child); on stdout
``{"pid": P}``, then any JSON lines the child prints, then ``{"status": S}`` (the raw wait status).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
from pathlib import Path

import torch  # noqa: F401 - imported before forking on purpose

import safepoint  # noqa: F401
from tests.torture import scenarios


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="safepoint-zygote-") as tmp:
        scenarios.warm_up(Path(tmp))
    assert threading.active_count() == 1, "the zygote must be single-threaded to fork safely"
    for line in sys.stdin:
        cmd = json.loads(line)
        sys.stdout.flush()
        # The child waits until its pid is announced, so nothing it prints can come before that line.
        gate_r, gate_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(gate_w)
                os.read(gate_r, 1)
                os.close(gate_r)
                code = scenarios.run_child(cmd)
            finally:
                sys.stdout.flush()
                os._exit(code)
        os.close(gate_r)
        os.write(1, (json.dumps({"pid": pid}) + "\n").encode())
        os.close(gate_w)
        _, status = os.waitpid(pid, 0)
        os.write(1, (json.dumps({"status": status}) + "\n").encode())


if __name__ == "__main__":
    main()
