"""Run a framework example (examples/<fw>_train.py) as a real process group, stop it with a real signal at
a printed step, and read what it printed: the contract tests/integrations/ check for every framework.

By default the job is forked from a server that imported torch and the script's modules once
(tests/helpers/forkserver.py: its own session, the test's pipes, the interpreter's own exit), which saves the
5-8 s of CPU each fresh process spends importing them; ``fresh=True`` runs ``python examples/<script>`` as a
user would, and every framework keeps at least one test that does.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from tests.conftest import REPO
from tests.helpers import forkserver
from tests.helpers.launch import AGENT_IMPORTS, AGENT_PER_RUN

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
    fresh: bool = False,
) -> Run:
    """Run ``examples/<script>`` on ``root``; with ``stop_at``, send ``sig`` to its whole process group
    (its DataLoader workers included) as soon as it has printed that step. ``fresh``: a new interpreter
    (``python examples/<script>``) rather than a child of the fork server."""
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
        proc: subprocess.Popen[str] | forkserver.Child
        if fresh:
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True
            )
            assert proc.stdout is not None
            stdout = proc.stdout
        else:
            out_r, out_w = os.pipe()
            try:
                proc = forkserver.spawn(preload(cmd[1]), cmd[1:], env, out_w, err.fileno(), os.getcwd())
            except BaseException:
                os.close(out_r)
                raise
            finally:
                os.close(out_w)  # the child holds the write end now: EOF when it and its workers end
            stdout = open(out_r)  # noqa: SIM115 - closed below
        deadline = time.monotonic() + timeout
        try:
            for line in stdout:
                m = _STEP.match(line.strip())
                if m:
                    losses.append((int(m.group(1)), m.group(2)))
                    if stop_at is not None and losses[-1][0] == stop_at:
                        os.killpg(proc.pid, sig)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{script} ran past {timeout}s")
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
        finally:
            stdout.close()
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert proc.returncode is not None
    return Run(losses, proc.returncode, err_path.read_text())


@functools.cache
def preload(script: str) -> tuple[str, ...]:
    """The import statements the fork server runs for ``script``: the script's own top-level ones (as
    written: ``from transformers import Trainer`` loads what ``import transformers`` defers), torch.optim's
    lazy ``torch._dynamo`` (~1.6 s at the first optimizer) and PEFT (hf_trainer_train.py imports it under
    ``--lora``)."""
    tree = ast.parse(Path(script).read_text())
    imports = ["import torch._dynamo"]
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom) and getattr(node, "module", "") != "__future__":
            imports.append(ast.unparse(node))
    if any("transformers" in i for i in imports):
        imports.append("import peft")
    return tuple(imports)


def committed_steps(root: Path) -> list[int]:
    """The steps committed under ``root`` (a directory with its manifest), oldest first."""
    steps = [int(p.name[5:]) for p in root.glob("step-*") if (p / "safepoint.json").is_file()]
    return sorted(steps)


# The fork server's preload for the suite's own safepoint jobs (tests/save/_restart_job.py, ...): one server
# per pytest worker serves every file that uses it (same imports, same environment). The torchrun agents'
# (torch, DCP, safepoint and torchrun's launcher): an agent of tests/helpers/launch.py ``start`` has the same
# environment, so agents and jobs share one pool of servers instead of starting one of each.
JOB_IMPORTS = AGENT_IMPORTS


def job_env() -> dict[str, str]:
    """The environment of a forked job: this checkout's safepoint and tests, one OpenMP thread (the server
    must stay single-threaded to fork safely)."""
    return dict(os.environ, PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{REPO}", OMP_NUM_THREADS="1")


def run_job(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([python, *argv], cwd=REPO, capture_output=True, text=True)``, forked from the fork
    server (its own session, the interpreter's own exit): for tests whose subject is not the interpreter's
    start."""
    return forkserver.run(JOB_IMPORTS, argv, job_env(), timeout, cwd=str(REPO))


def spawn_job(argv: list[str], stdout: int, stderr: int) -> forkserver.Child:
    """``Popen([python, *argv], cwd=REPO, start_new_session=True)`` with these descriptors, forked."""
    return forkserver.spawn(JOB_IMPORTS, argv, job_env(), stdout, stderr, str(REPO))


class PipedJob:
    """What the tests use of ``Popen([python, *argv], stdin=PIPE, stdout=PIPE, text=True, env=...)``, the
    process forked from the suite's fork server (its own session, the interpreter's own exit): ``stdin``,
    ``stdout``, ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``kill``, ``communicate``. Its
    stderr is the test's unless ``stderr`` names a descriptor; ``text=False``: binary pipes. ``extra_env``: variables added to the suite's job environment; ``per_run``: those
    of them that nothing imported reads (they key no fork server of their own, ~5 s of CPU each);
    ``hostname``: a UTS namespace of its own with that host name (what ``unshare --uts`` and ``hostname``
    give)."""

    def __init__(
        self,
        argv: list[str],
        *,
        extra_env: dict[str, str] | None = None,
        per_run: tuple[str, ...] = (),
        hostname: str | None = None,
        stderr: int | None = 2,
        text: bool = True,
    ) -> None:
        self.args = [sys.executable, *argv]
        # stderr=None: captured (``communicate`` returns it), as ``Popen(stderr=PIPE)`` without a pipe to
        # drain: a file.
        self._err = tempfile.TemporaryFile() if stderr is None else None  # noqa: SIM115 - closed by communicate
        err_fd = self._err.fileno() if self._err is not None else stderr
        assert err_fd is not None
        env = dict(job_env(), **(extra_env or {}))
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            self._child = forkserver.spawn(
                JOB_IMPORTS, argv, env, out_w, err_fd, str(REPO), per_run=per_run, hostname=hostname,
                stdin=in_r,
            )  # fmt: skip
        except BaseException:
            os.close(in_w)
            os.close(out_r)
            raise
        finally:
            os.close(in_r)
            os.close(out_w)
        mode = "" if text else "b"
        self.stdin: IO[Any] = open(in_w, "w" + mode)  # noqa: SIM115 - closed by communicate or wait
        self.stdout: IO[Any] = open(out_r, "r" + mode)  # noqa: SIM115
        self.pid = self._child.pid

    @property
    def returncode(self) -> int | None:
        return self._child.returncode

    def poll(self) -> int | None:
        return self._child.poll()

    def wait(self, timeout: float | None = None) -> int:
        try:
            code = self._child.wait(timeout)
        except TimeoutError:
            raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
        for f in (self.stdin, self.stdout):
            with contextlib.suppress(BrokenPipeError):
                f.close()
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: str = "", timeout: float | None = None) -> tuple[str, str | None]:
        with contextlib.suppress(BrokenPipeError):
            if input:
                self.stdin.write(input)
            self.stdin.close()
        out = self.stdout.read()
        self.wait(timeout)
        if self._err is None:
            return out, None
        self._err.seek(0)
        err = self._err.read().decode(errors="replace")
        self._err.close()
        return out, err


def _killpg(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def run_forked_rank_job(
    imports: tuple[str, ...],
    argv: list[str],
    root: Path,
    *,
    kill_at: int | None = None,
    kill: Callable[[int], None] | None = None,
    rank_servers: int = 0,
    lightning_ranks: int = 0,
) -> tuple[dict[tuple[int, int], str], int, str]:
    """tests/helpers/rank_jobs.py ``run_rank_job`` for ``python ARGV...``, its first process forked from the
    fork server that ran ``imports`` (it leads its own session, as there): a job that launches its other
    processes itself (Lightning's rank 1, torchrun's workers) starts them as fresh interpreters unless told
    below. With
    ``kill_at``, ``kill(pid)`` once rank 0 printed that step (default: kill -9 of the process group).
    ``rank_servers``: ARGV is ``-m torch.distributed.run ...`` and its ranks are forked too
    (tests/helpers/launch.py ``Agent``). ``lightning_ranks``: ARGV is a Lightning job, and this many of the
    ranks its launcher starts are forked from rank servers of rank 0 (tests/helpers/rank_servers.py
    ``fork_lightning_ranks``). Returns ``{(rank, step): loss}``, the exit code and stderr."""
    env = dict(job_env(), CUDA_VISIBLE_DEVICES="")
    err_path = root.parent / f"{root.name}-{time.monotonic_ns()}.stderr"
    losses: dict[tuple[int, int], str] = {}
    line_re = re.compile(r"rank (\d+) step (\d+) loss (\S+)\Z")
    with open(err_path, "w") as err:
        out_r, out_w = os.pipe()
        try:
            proc = forkserver.spawn(
                imports, argv, env, out_w, err.fileno(), str(REPO),
                rank_servers=rank_servers or lightning_ranks,
                ranks_for="lightning" if lightning_ranks else "torchrun",
                # an agent's server: keyed and started as tests/helpers/launch.py ``Agent``'s
                per_run=AGENT_PER_RUN if rank_servers else (),
                server_env={"OMP_NUM_THREADS": "1"} if rank_servers else None,
            )  # fmt: skip
        except BaseException:
            os.close(out_r)
            raise
        finally:
            os.close(out_w)  # the job holds the write end now: EOF when all its ranks end
        try:
            with open(out_r) as stdout:
                for line in stdout:
                    m = line_re.match(line.strip())
                    if m:
                        rank, step = int(m.group(1)), int(m.group(2))
                        losses[(rank, step)] = m.group(3)
                        if (rank, step) == (0, kill_at):
                            (kill or _killpg)(proc.pid)
            proc.wait(timeout=300)
        finally:
            if proc.returncode is None:
                (kill or _killpg)(proc.pid)
                proc.wait()
    assert proc.returncode is not None
    return losses, proc.returncode, err_path.read_text()
