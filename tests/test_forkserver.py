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

import pytest

from tests.conftest import REPO
from tests.helpers import forkserver, launch

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


def _both(script: Path | str, mode: str, tmp_path: Path) -> list[subprocess.CompletedProcess[str]]:
    """``python SCRIPT MODE`` (a str: ``python -c SCRIPT MODE``) fresh, then forked."""
    env = dict(os.environ, PROBE_VAR="yes", OMP_NUM_THREADS="1")
    argv = [str(script), mode] if isinstance(script, Path) else ["-c", script, mode]
    fresh = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=env, cwd=tmp_path,
        start_new_session=True, stdin=subprocess.DEVNULL, timeout=60,
    )  # fmt: skip
    forked = forkserver.run((), argv, env, timeout=60, cwd=str(tmp_path))
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


def test_a_forked_child_reads_the_pipe_the_test_gave_as_its_stdin(tmp_path: Path) -> None:
    """A third descriptor (tests/helpers/example_runs.py ``PipedJob``) is the child's stdin: what the test
    writes, then EOF once the test closes its end."""
    code = "import sys; print(repr(sys.stdin.readline())); print(repr(sys.stdin.read()), flush=True)"
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    try:
        child = forkserver.spawn((), ["-c", code], dict(os.environ), out_w, 2, str(tmp_path), stdin=in_r)
    finally:
        os.close(in_r)
        os.close(out_w)
    with open(in_w, "w") as f:
        f.write("go\nrest")
    with open(out_r) as f:
        out = f.read()
    assert child.wait(60) == 0
    assert out.splitlines() == ["'go\\n'", "'rest'"]


def test_a_forked_python_c_looks_like_a_fresh_one(tmp_path: Path) -> None:
    """``python -c CODE ARGS``: argv[0] "-c", sys.path[0] "", ``__main__``, exit codes, atexit."""
    for mode, code in (("3", 3), ("raise", 1)):
        fresh, forked = _both(PROBE, mode, tmp_path)
        assert (fresh.returncode, forked.returncode) == (code, code), (mode, fresh.stderr, forked.stderr)
        seen = [json.loads(r.stdout.splitlines()[0]) for r in (fresh, forked)]
        assert seen[0] == seen[1], mode
        assert seen[1]["path0"] == "" and seen[1]["argv"] == [mode] and seen[1]["main"] == "__main__"
        if mode == "3":
            assert [r.stdout.splitlines()[-1] for r in (fresh, forked)] == ["atexit ran"] * 2
        else:
            assert all(r.stderr.rstrip().endswith("ValueError: boom") for r in (fresh, forked))


RANK_PROBE = """
import atexit, json, os, signal, sys, time
preloaded = "safepoint" in sys.modules  # forked from a rank server that imported it; a fresh one did not
# Registered first, so it runs last: rank 0 is done, its atexit line written (see the end).
atexit.register(lambda: open(f"done-{os.environ['RANK']}", "w").close())
atexit.register(lambda: sys.stdout.write(f"rank {os.environ['RANK']} atexit ran\\n"))
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "OMP_NUM_THREADS", "PROBE_VAR")
seen = {
    "session_leader": os.getsid(0) == os.getpid() == os.getpgid(0),
    "agent_session": os.getsid(os.getppid()) != os.getsid(0),
    "handlers": {n: str(signal.getsignal(getattr(signal, n))) for n in ("SIGINT", "SIGTERM", "SIGPIPE", "SIGCHLD")},
    "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:], "path0": sys.path[0], "cwd": os.getcwd(),
    "main": __name__, "stdin": os.read(0, 10).decode(), "unbuffered": sys.stdout.write_through,
}
sys.stdout.write(json.dumps({"preloaded": preloaded, **seen}) + "\\n")
code = int(sys.argv[1]) if os.environ["RANK"] == "1" else 0
if code:  # torchrun stops the other rank when this one fails: only once rank 0 has finished on its own
    deadline = time.monotonic() + 120
    while not os.path.exists("done-0") and time.monotonic() < deadline:
        time.sleep(0.01)
if code == 9:
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(code)
"""


def _probe_runs(script: Path, mode: str, tmp_path: Path) -> list[tuple[int, str, str]]:
    """``torchrun --nproc-per-node=2 SCRIPT MODE`` as a fresh process, then with a forked agent."""
    args = ["--standalone", "--nproc-per-node=2", "--monitor-interval=0.1", str(script), mode]
    # TORCHINDUCTOR_CACHE_DIR keys no fork server (torch sets it in the test process midway through a run):
    # the ranks' environment has it, their server's imports ran without it, and they are still forked.
    inductor = str(tmp_path / "inductor")
    env = dict(os.environ, PROBE_VAR="yes", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    env["TORCHINDUCTOR_CACHE_DIR"] = inductor
    for done in tmp_path.glob("done-*"):
        done.unlink()
    fresh = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *args], capture_output=True, text=True, env=env,
        cwd=tmp_path, start_new_session=True, stdin=subprocess.DEVNULL, timeout=120,
    )  # fmt: skip
    for done in tmp_path.glob("done-*"):
        done.unlink()  # a rank 1 that fails waits for rank 0's, of its own launch
    forked = launch.run_agent(args, env, timeout=120, cwd=tmp_path)
    return [(r.returncode, r.stdout, r.stderr) for r in (fresh, forked)]


# The default suite compares a killed rank (kill -9: the case the crash tests lean on, and it runs rank 0's
# normal exit too); a clean exit and an exit code are -m slow (time bar: each mode is two torchrun launches,
# one of them with fresh interpreters).
@pytest.mark.parametrize(
    "modes", [("9",), pytest.param(("0", "3"), marks=pytest.mark.slow)], ids=["kill9", "exits"]
)
def test_a_forked_rank_looks_like_one_torchrun_started(tmp_path: Path, modes: tuple[str, ...]) -> None:
    """A forked agent's ranks come from its rank servers (they find safepoint imported) and otherwise look
    like the fresh ``python -u SCRIPT`` torchrun starts: their own session, torchrun's environment, argv,
    unbuffered output, the interpreter's own exit; a failed or killed rank fails the launch alike."""
    script = tmp_path / "rank_probe.py"
    script.write_text(RANK_PROBE)
    # The fork server starts (in the first launch) while this process ignores SIGINT: a fresh rank still
    # gets Python's handler (torchrun handles SIGINT before it execs the ranks), and so must a forked one.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _compare_ranks(script, tmp_path, modes)
    finally:
        signal.signal(signal.SIGINT, previous)


def _compare_ranks(script: Path, tmp_path: Path, modes: tuple[str, ...]) -> None:
    for mode in modes:
        (fresh_rc, fresh_out, fresh_err), (forked_rc, forked_out, forked_err) = _probe_runs(
            script, mode, tmp_path
        )
        assert fresh_rc == forked_rc == (0 if mode == "0" else 1), (mode, fresh_err, forked_err)
        probes = [
            sorted((json.loads(line) for line in out.splitlines() if line.startswith("{")), key=str)
            for out in (fresh_out, forked_out)
        ]
        assert [p["preloaded"] for p in probes[0]] == [False, False], mode
        assert [p["preloaded"] for p in probes[1]] == [True, True], mode
        for p in (*probes[0], *probes[1]):
            del p["preloaded"]
        assert probes[0] == probes[1], (mode, probes)
        assert all(p["session_leader"] and p["agent_session"] and p["unbuffered"] for p in probes[1])
        assert {p["env"]["RANK"] for p in probes[1]} == {"0", "1"}
        assert probes[1][0]["env"]["PROBE_VAR"] == "yes" and probes[1][0]["argv"] == [mode]
        atexit = {line for line in forked_out.splitlines() if "atexit" in line}
        assert atexit == {line for line in fresh_out.splitlines() if "atexit" in line}, mode
        if mode == "0":
            assert atexit == {"rank 0 atexit ran", "rank 1 atexit ran"}
        else:  # torchrun reports the failed rank the same way; rank 0 had finished before rank 1 failed
            assert "rank 0 atexit ran" in atexit, mode
            want = "exitcode  : 3" if mode == "3" else "Signal 9 (SIGKILL)"
            assert want in fresh_err and want in forked_err, (fresh_err[-2000:], forked_err[-2000:])
