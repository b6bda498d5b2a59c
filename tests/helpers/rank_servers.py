"""Ranks forked for a torchrun agent (tests/helpers/launch.py ``Agent``, forkserver.py
``spawn(..., rank_servers=N)``).

Why: every rank that torchrun starts is a fresh ``python -u SCRIPT`` that spends ~4.5 s of CPU importing
torch, DCP and safepoint before it does anything; the suite starts hundreds. torchrun itself stays real:
its rendezvous, its monitoring, its restarts, its signals (``os.killpg`` of each rank, which leads its own
session as ``Popen(start_new_session=True)`` makes it). Only the rank's interpreter start changes: the
agent's ``SubprocessHandler`` asks one of its rank servers for the process instead of ``Popen``.

Where the rank servers come from: the agent is forked from a fork server that already imported what the
ranks import; before torchrun starts (the agent is still single-threaded, as its server was), the agent
forks one rank server per local rank. Forking later, from the running agent, would be unsafe: torchrun
runs threads (its store, its monitors), and a fork copies their locks in whatever state they are. A rank
server is forkserver.py's serve() loop: each rank it forks is a session leader with the agent's
descriptors (or its log files), the environment torchrun built, the interpreter's own exit, and its wait
status reported to the agent, as ``Popen`` would. The rank servers share the agent's session, process
group and UTS namespace (a group kill of the agent ends them with it); they exit when the agent's end of
their socket closes, and the agent reaps them at its exit.

A rank is forked only when nothing its server imported could have read a variable that differs: torchrun's
own variables and the suite's per-run ones are read after start-up; any other difference (another
OMP_NUM_THREADS, which OpenMP reads when torch loads) gets a fresh interpreter, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from collections.abc import Callable
from typing import Any

_READ_AFTER_START = frozenset(
    {
        "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
        "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "NODE_LOCAL_ROOT", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "CUDA_VISIBLE_DEVICES", "PYTEST_CURRENT_TEST",
    }
)  # fmt: skip


# torchrun's own; ``accelerate launch`` sets ACCELERATE_* for its ranks, which Accelerate reads when its
# objects are built (at import it reads only USE_TORCH_XLA).
_READ_AFTER_START_PREFIXES = ("TORCHELASTIC_", "ACCELERATE_")


def _forkable(
    args: list[str], env: dict[str, str], import_env: dict[str, str], unkeyed: tuple[str, ...]
) -> bool:
    if args[:2] != [sys.executable, "-u"]:
        return False
    names = set(env) | set(import_env)
    changed = {n for n in names if env.get(n) != import_env.get(n)}
    return all(
        n in _READ_AFTER_START or n in unkeyed or n.startswith(_READ_AFTER_START_PREFIXES) for n in changed
    )


def _fork_rank_server(
    others: list[socket.socket], serve: Callable[[socket.socket], None]
) -> tuple[socket.socket, int]:
    """Fork a rank server (a serve() loop); returns the agent's end of its socket and the server's pid."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid:
        theirs.close()
        return mine, pid
    server = os.getpid()
    for sock in (mine, *others):  # the agent's ends: the agent's exit must close every one of them
        sock.close()
    devnull = os.open(os.devnull, os.O_RDWR)  # never the agent's pipes: the test reads them to EOF
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    serve(theirs)
    if os.getpid() == server:
        os._exit(0)  # the agent is gone; nothing of the agent's code may run here
    # A rank whose script returned: the interpreter's normal exit, status 0 (threads joined, atexit).
    raise SystemExit(0)


_CATCHABLE = sorted(signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP})


class _Rank:
    """What torchrun's SubprocessContext uses of a ``Popen``, for a rank a rank server forked."""

    def __init__(
        self, sock: socket.socket, args: list[str], env: dict[str, str], out: int, err: int, *,
        session: bool = True, cwd: str | None = None,
    ) -> None:  # fmt: skip
        self.args, self.sock = args, sock
        # The signal state ``exec`` hands a rank: the agent's mask, its ignored signals ignored, every other
        # disposition the default (torchrun handles SIGINT and SIGTERM by now; the rank server was forked
        # before, with whatever the test process had when the fork server started).
        ignored = [int(n) for n in _CATCHABLE if signal.getsignal(n) == signal.SIG_IGN]
        mask = sorted(int(n) for n in signal.pthread_sigmask(signal.SIG_BLOCK, []))
        signals = {"ignored": ignored, "mask": mask}
        request = {
            "argv": args[1:], "env": env, "cwd": cwd or os.getcwd(), "signals": signals, "session": session
        }  # fmt: skip
        socket.send_fds(sock, [json.dumps(request).encode()], [out, err])
        self.pid = self._receive("pid", 60)
        self.returncode: int | None = None

    def _receive(self, key: str, timeout: float | None) -> int:
        self.sock.settimeout(timeout)
        msg = self.sock.recv(1 << 16)
        if not msg:
            raise RuntimeError("a rank server exited")
        value: int = json.loads(msg)[key]
        return value

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                status = self._receive("status", timeout)
            except (TimeoutError, BlockingIOError):
                raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _reap(servers: list[socket.socket], pids: list[int]) -> None:
    """At the agent's exit: end its rank servers and reap them, as torchrun reaps the ranks it starts (their
    CPU time is then the agent's children's, where ``/usr/bin/time`` and ``getrusage`` count it). Bounded:
    the agent's exit must never wait on a stuck rank."""
    for sock in servers:
        sock.close()
    deadline = time.monotonic() + 5
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
                time.sleep(0.01)


def _fork_rank_servers(count: int, serve: Callable[[socket.socket], None]) -> list[socket.socket]:
    """``count`` rank servers forked from this process (``serve``: the fork server's loop), reaped at
    exit (registered after the forks: the rank servers and their ranks lack it)."""
    servers: list[socket.socket] = []
    pids = []
    for _ in range(count):
        sock, pid = _fork_rank_server(servers, serve)
        servers.append(sock)
        pids.append(pid)
    atexit.register(_reap, servers, pids)
    return servers


def fork_ranks(
    count: int, serve: Callable[[socket.socket], None], import_env: dict[str, str], unkeyed: tuple[str, ...]
) -> None:
    """In a torchrun agent, before torchrun runs: fork ``count`` rank servers (``serve``: the fork server's
    loop) and have torchrun's SubprocessContext start its ranks through them. ``import_env``: the
    environment the fork server's imports ran under; ``unkeyed``: the variables that key no fork server
    (forkserver.py ``_PER_TEST``: nothing imported reads them), which a rank's environment may add."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    assert len(os.listdir("/proc/self/task")) == 1, (
        "rank servers are forked from a single-threaded agent only"
    )
    servers = _fork_rank_servers(count, serve)
    ranks: dict[int, _Rank] = {}

    class Handler(SubprocessHandler):
        def _popen(self, args: tuple[str, ...], env: dict[str, str]) -> Any:
            if not _forkable(list(args), env, import_env, unkeyed) or self.local_rank_id >= len(servers):
                return super()._popen(args, env)
            last = ranks.get(self.local_rank_id)
            if last is not None:
                last.wait()  # a restart: torchrun already ended the last one; its server reports it first
            out = self._stdout.fileno() if self._stdout else 1
            err = self._stderr.fileno() if self._stderr else 2
            rank = ranks[self.local_rank_id] = _Rank(servers[self.local_rank_id], list(args), env, out, err)
            return rank

    def handler(**kwargs: Any) -> SubprocessHandler:
        return Handler(**kwargs)

    # The name api.py's SubprocessContext calls (its own import of it).
    setattr(api, "get_subprocess_handler", handler)  # noqa: B010


# What Lightning's launcher sets for the ranks it starts, read once the trainer runs (not at import):
# its cluster environment's NODE_RANK, and seed_everything's PL_GLOBAL_SEED / PL_SEED_WORKERS.
_LIGHTNING_READ_AFTER_START = frozenset({"NODE_RANK", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"})


def fork_lightning_ranks(
    count: int, serve: Callable[[socket.socket], None], import_env: dict[str, str], unkeyed: tuple[str, ...]
) -> None:
    """In a Lightning job's rank 0, before its script runs: fork ``count`` rank servers and have Lightning's
    ``_SubprocessScriptLauncher`` start its other ranks (``Popen([python, SCRIPT, ...], env=..., cwd=...)``,
    no new session) through them. Each rank is what that ``Popen`` gives: rank 0's session and process group
    (a kill of the group reaches it), its stdout and stderr, the environment and signal state exec would
    give, the interpreter's own exit; Lightning's observer polls and signals it as a ``Popen``. Any other
    call, or a rank whose environment differs in a variable read at import, gets the real ``Popen``."""
    from lightning.pytorch.strategies.launchers import subprocess_script

    assert len(os.listdir("/proc/self/task")) == 1, (
        "rank servers are forked from a single-threaded rank 0 only"
    )
    servers = _fork_rank_servers(count, serve)
    started: list[_Rank] = []

    def popen(args: Any, env: dict[str, str] | None = None, cwd: str | None = None, **kw: Any) -> Any:
        args = [str(a) for a in args]
        names = set(env or {}) | set(import_env)
        changed = {n for n in names if (env or {}).get(n) != import_env.get(n)}
        allowed = _READ_AFTER_START | _LIGHTNING_READ_AFTER_START
        if (
            kw or env is None or len(started) >= len(servers) or args[0] != sys.executable
            or not all(n in allowed or n in unkeyed for n in changed)
        ):  # fmt: skip
            return subprocess.Popen(args, env=env, cwd=cwd, **kw)
        rank = _Rank(servers[len(started)], args, env, 1, 2, session=False, cwd=cwd)
        started.append(rank)
        return rank

    # The launcher module's only use of ``subprocess`` is its Popen call (and an annotation).
    shim = types.SimpleNamespace(**{**vars(subprocess), "Popen": popen})
    setattr(subprocess_script, "subprocess", shim)  # noqa: B010
