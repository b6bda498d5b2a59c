"""Runs of tests/helpers/procs/goodput_worker.py for the report tests: the whole run, or one killed with a
real SIGKILL once it prints ``REACHED`` (no close(), no atexit, no flush)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.conftest import REPO, SUBPROCESS_ENV

WORKER = [sys.executable, "-m", "tests.helpers.procs.goodput_worker"]


def run_worker(
    args: list[str], *, hang: bool, env: dict[str, str] | None = None, settle_s: float = 0.0
) -> tuple[list[str], int]:
    """(lines printed, exit status). ``hang``: SIGKILL the job ``settle_s`` after it prints ``REACHED``;
    otherwise it must exit 0. ``env``: extra variables for the job, over this process's environment as it is
    now (the store fixtures set credentials after the suite started)."""
    proc = subprocess.Popen(
        WORKER + args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": SUBPROCESS_ENV["PYTHONPATH"], **(env or {})},
    )
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if hang and line.startswith("REACHED"):
                time.sleep(settle_s)
                proc.send_signal(signal.SIGKILL)
                break
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if not hang:
        assert rc == 0, proc.stderr.read() if proc.stderr else ""
    return lines, rc
