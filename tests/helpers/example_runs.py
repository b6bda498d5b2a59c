"""Run a framework example (examples/<fw>_train.py) as a real process group, stop it with a real signal at
a printed step, and read what it printed: the contract tests/integrations/ check for every framework."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO

EXAMPLES = REPO / "examples"
_STEP = re.compile(r"step (\d+) loss (\S+)\Z")


@dataclasses.dataclass(frozen=True)
class Run:
    losses: list[tuple[int, str]]
    """Each printed ``(step, loss)``, in order (the loss as printed: ``repr`` of the float, exact)."""
    returncode: int
    stderr: str

    @property
    def first(self) -> int | None:
        return self.losses[0][0] if self.losses else None

    @property
    def last(self) -> int | None:
        return self.losses[-1][0] if self.losses else None


def run_example(
    script: str,
    root: Path,
    *args: str,
    stop_at: int | None = None,
    sig: int = signal.SIGKILL,
    step_sleep: float = 0.0,
    timeout: float = 400,
) -> Run:
    """Run ``examples/<script>`` on ``root``; with ``stop_at``, send ``sig`` to its whole process group
    (its DataLoader workers included) as soon as it has printed that step."""
    cmd = [sys.executable, str(EXAMPLES / script), "--root", str(root), *args]
    if step_sleep:
        cmd += ["--step-sleep", str(step_sleep)]
    # REPO too: the suite's own jobs (tests/integrations/torchtitan_job.py) end through tests/helpers/procs.
    env = dict(
        os.environ,
        PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{REPO}",
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
    )
    err_path = root.parent / f"{root.name}-{time.monotonic_ns()}.stderr"
    losses: list[tuple[int, str]] = []
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True
        )
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        try:
            for line in proc.stdout:
                m = _STEP.match(line.strip())
                if m:
                    losses.append((int(m.group(1)), m.group(2)))
                    if stop_at is not None and losses[-1][0] == stop_at:
                        os.killpg(proc.pid, sig)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{script} ran past {timeout}s")
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return Run(losses, proc.returncode, err_path.read_text())


def committed_steps(root: Path) -> list[int]:
    """The steps committed under ``root`` (a directory with its manifest), oldest first."""
    steps = [int(p.name[5:]) for p in root.glob("step-*") if (p / "safepoint.json").is_file()]
    return sorted(steps)
