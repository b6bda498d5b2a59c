"""tests/helpers/forkserver.py: a child forked from the fork server looks to the test like ``python SCRIPT``
started with ``Popen(start_new_session=True)``: same session and group layout, signal dispositions and mask,
environment, argv, sys.path[0], working directory, exit codes (a signal as ``-signum``, an uncaught
exception as 1 with its traceback), and the interpreter's own exit (atexit handlers run)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers import forkserver

PROBE = """
import atexit, json, os, signal, sys
mode = sys.argv[1]
atexit.register(lambda: print("atexit ran", flush=True))
print(json.dumps({
    "session_leader": os.getsid(0) == os.getpid() == os.getpgid(0),
    "handlers": {n: str(signal.getsignal(getattr(signal, n))) for n in ("SIGINT", "SIGTERM", "SIGPIPE", "SIGCHLD")},
    "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "env": os.environ.get("PROBE_VAR"), "argv": sys.argv[1:], "path0": sys.path[0], "cwd": os.getcwd(),
    "main": __name__, "stdin": os.read(0, 10).decode(),
}), flush=True)
if mode == "raise":
    raise ValueError("boom")
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(mode))
"""


def _both(script: Path, mode: str, tmp_path: Path) -> list[subprocess.CompletedProcess[str]]:
    env = dict(os.environ, PROBE_VAR="yes", OMP_NUM_THREADS="1")
    fresh = subprocess.run(
        [sys.executable, str(script), mode], capture_output=True, text=True, env=env, cwd=tmp_path,
        start_new_session=True, stdin=subprocess.DEVNULL, timeout=60,
    )  # fmt: skip
    forked = forkserver.run((), [str(script), mode], env, timeout=60, cwd=str(tmp_path))
    return [fresh, forked]


def test_a_forked_child_looks_like_a_fresh_process(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    for mode, code in (("0", 0), ("3", 3), ("kill", -signal.SIGKILL), ("raise", 1)):
        fresh, forked = _both(script, mode, tmp_path)
        assert (fresh.returncode, forked.returncode) == (code, code), (mode, fresh.stderr, forked.stderr)
        seen = [json.loads(r.stdout.splitlines()[0]) for r in (fresh, forked)]
        assert seen[0] == seen[1], mode
        assert seen[1]["session_leader"] and seen[1]["env"] == "yes" and seen[1]["main"] == "__main__"
        assert seen[1]["argv"] == [mode] and seen[1]["path0"] == str(tmp_path) and seen[1]["stdin"] == ""
        if mode in ("0", "3", "raise"):  # the interpreter's own exit: atexit handlers run
            assert [r.stdout.splitlines()[-1] for r in (fresh, forked)] == ["atexit ran"] * 2
        if mode == "raise":
            assert all(r.stderr.rstrip().endswith("ValueError: boom") for r in (fresh, forked))
