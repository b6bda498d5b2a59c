"""A fork server for the framework example jobs: one process imports torch and the frameworks once, then
forks a child per run that becomes ``python SCRIPT ARGS...`` as the test asked (tests/helpers/example_runs.py).

Why: each example job paid 5-8 s of CPU only to import torch and its framework, and a test runs four or five
of them; a forked child starts in tens of milliseconds. What the test sees is what a fresh process gives it:

- the child is the leader of a new session and process group (``os.setsid``), so ``os.killpg(pid, sig)``
  reaches it and its DataLoader workers, as with ``Popen(start_new_session=True)``; its pid is announced only
  once it leads its group;
- its stdin is ``/dev/null`` unless the test sent a third descriptor (its end of a pipe); its stdout and
  stderr are the descriptors the test sent (a pipe, a file);
- its environment, working directory, ``sys.argv`` and ``sys.path[0]`` are what ``python SCRIPT`` (or
  ``python -m MODULE``) would have;
- signal dispositions and mask are the fresh interpreter's: the server never changes them;
- it ends through the interpreter's own exit (non-daemon threads joined, ``atexit`` handlers, an uncaught
  exception printed with exit code 1), and the test gets its wait status, a signal as ``-signum``.

What would be wrong after a fork is checked before the first one: the server must have a single thread (no
native thread either: ``/proc/self/task``), and libraries that read the environment when imported (OpenMP
reads ``OMP_NUM_THREADS`` when torch loads it) see the jobs' environment: the client starts one server per
environment. With more than one OpenMP thread, importing torch starts a thread: the server refuses to run,
so jobs forked from it run with ``OMP_NUM_THREADS=1``, as the suite's jobs do anyway. No CUDA here
(``CUDA_VISIBLE_DEVICES=""``).

Protocol, on a Unix ``SOCK_SEQPACKET`` socket (its fd number is ``argv[1]``; the rest of argv are the import
statements to run first, e.g. ``from transformers import Trainer``: many packages import lazily by name): the
process sends ``{"ready": true}`` once imported; then, for each message of the client, it forks a server and
answers with the client's end of that server's socket attached (jobs that run side by side each need a server:
a fork, not the imports again). On a server's socket the client sends one JSON request ``{"argv": [...], "env":
{...}, "cwd": ...}`` with two descriptors attached (stdout, stderr); the server answers ``{"pid": P}``, then
``{"status": S}`` (the raw wait status) when the child has ended. One run at a time per server.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import ctypes
import importlib.util
import io
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import types
from collections.abc import Callable


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _send(sock: socket.socket, msg: dict[str, object]) -> None:
    sock.send(json.dumps(msg).encode())  # one packet, one message


_CLONE_NEWUTS = 0x04000000


def _own_hostname(name: str) -> None:
    """What ``unshare --uts sh -c 'hostname NAME && exec ...'`` does: a UTS namespace of its own (its
    children inherit it) with host name ``name``. Python 3.11 has no ``os.unshare``."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWUTS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUTS)")
    socket.sethostname(name)


def _become(request: dict[str, object], fds: list[int], sock: socket.socket, ready_w: int) -> None:
    """In the child: turn into ``python argv[0] argv[1:]`` and run it; never returns to the server loop."""
    if request.get("session", True):  # False: a rank Lightning starts (``Popen`` without a new session)
        os.setsid()
    hostname = request.get("hostname")
    if hostname is not None:
        assert isinstance(hostname, str)
        _own_hostname(hostname)
    os.close(ready_w)  # the server announces the pid only now: a killpg can no longer miss the child
    sock.close()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fds[2] if len(fds) > 2 else devnull, 0)  # a third descriptor: the test's pipe to its stdin
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in {devnull, *fds} - {0, 1, 2}:
        os.close(fd)
    signals = request.get("signals")
    if signals is not None:  # a rank: the signal state exec gives it (tests/helpers/rank_servers.py)
        assert isinstance(signals, dict)
        _exec_signals(signals["ignored"], signals["mask"])
    env = request["env"]
    assert isinstance(env, dict)
    os.environ.clear()
    os.environ.update(env)
    cwd = request["cwd"]
    assert isinstance(cwd, str)
    os.chdir(cwd)
    argv = request["argv"]
    assert isinstance(argv, list)
    if argv[0] == "-u":  # ``python -u``: torchrun starts its Python ranks so
        argv = argv[1:]
        _unbuffered()
    ranks = request.get("rank_servers")
    if ranks:  # a torchrun agent or Lightning rank 0 whose ranks are forked (below), before a thread starts
        assert isinstance(ranks, int)
        _fork_ranks(ranks, str(request.get("ranks_for", "torchrun")))
    if argv[0] == "-c":  # ``python -c CODE ARGS``: argv[0] is "-c", sys.path[0] "" (the working directory)
        sys.argv = ["-c", *(str(a) for a in argv[2:])]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = main
        exec(compile(str(argv[1]), "<string>", "exec"), main.__dict__)
        return
    if argv[0] == "-m":  # ``python -m MODULE ARGS``: sys.path[0] is the working directory
        sys.argv = [str(a) for a in argv[1:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
        return
    script = os.path.abspath(argv[0])
    sys.argv = [str(a) for a in argv]
    sys.path[0] = os.path.dirname(script)  # as ``python SCRIPT`` sets it
    runpy.run_path(script, run_name="__main__")
    # Returning ends the server's main in this child: the interpreter's normal exit, with status 0 (or
    # the script's SystemExit / uncaught exception, raised through here, as a fresh process would end).


def _exec_signals(ignored: list[int], mask: list[int]) -> None:
    """What ``exec`` of a Python interpreter does to the signal state the parent had: the mask kept, ignored
    signals stay ignored, handled ones go back to their default; then Python's start-up: SIGINT raises
    KeyboardInterrupt unless ignored, SIGPIPE and SIGXFSZ ignored."""
    for n in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}:
        if n in ignored or n in (signal.SIGPIPE, signal.SIGXFSZ):
            action: signal.Handlers | Callable[..., object] = signal.SIG_IGN
        elif n == signal.SIGINT:
            action = signal.default_int_handler
        else:
            action = signal.SIG_DFL
        with contextlib.suppress(OSError, ValueError):  # signals the C library keeps (32, 33)
            signal.signal(n, action)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _unbuffered() -> None:
    """What ``python -u`` gives: stdout and stderr unbuffered (a raw binary layer, a write-through text one)."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(raw, encoding=old.encoding, errors=old.errors, write_through=True)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


# Ranks forked for a torchrun agent or Lightning's rank 0 (``spawn(..., rank_servers=N)``):
# tests/helpers/rank_servers.py. The environment the server's imports ran under, for it to tell whether a
# rank's may differ.
_IMPORT_ENV: dict[str, str] = {}


def _fork_ranks(count: int, ranks_for: str) -> None:
    """Load tests/helpers/rank_servers.py by its path (this server runs as a script: ``tests`` may not be on
    its path) and fork the rank servers."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_servers.py")
    spec = importlib.util.spec_from_file_location("_rank_servers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fork = module.fork_lightning_ranks if ranks_for == "lightning" else module.fork_ranks
    fork(count, serve, _IMPORT_ENV, _PER_TEST)


def main() -> None:
    fd, *imports = sys.argv[1:]
    _IMPORT_ENV.update(os.environ)
    for statement in imports:
        exec(statement, {})  # an import statement, written by the test suite
    assert threading.active_count() == 1 and _threads() == 1, (
        f"the fork server must be single-threaded to fork safely: {_threads()} threads after the imports"
    )
    sock = socket.socket(fileno=int(fd))
    _send(sock, {"ready": True})
    _fork_servers(sock)


def _fork_servers(sock: socket.socket) -> None:
    """Fork one server (a serve() loop) per request and send the client its end of the server's socket, until
    the client goes away; then reap them (their CPU time, and their jobs', becomes this process's, which the
    test process reaps). Returns in this process and, in each server, as serve() returns there."""
    servers = []
    while True:
        if not sock.recv(1 << 16):
            break  # the client went away
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            sock.close()
            mine.close()
            serve(theirs)
            return
        theirs.close()
        socket.send_fds(sock, [b"{}"], [mine.fileno()])
        mine.close()
        servers.append(pid)
    for pid in servers:
        os.waitpid(pid, 0)


def serve(sock: socket.socket) -> None:
    """Fork one child per request until the client goes away. Returns in the server (client gone) and,
    once its script has run, in each child (see _become)."""
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
        if not msg:
            return  # the client went away
        request = json.loads(msg)
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            _become(request, fds, sock, ready_w)
            return
        for fd in fds:
            os.close(fd)
        os.close(ready_w)
        os.read(ready_r, 1)  # EOF once the child leads its own session
        os.close(ready_r)
        with contextlib.suppress(OSError):  # a rank server whose agent died: nobody to tell
            _send(sock, {"pid": pid})
            _, status = os.waitpid(pid, 0)
            _send(sock, {"status": status})


# The client side (the test process).

_START_TIMEOUT = 300  # imports on a loaded 2-core machine; only a hang gets near it


class Child:
    """A job the server forked: ``pid`` leads its own process group; ``wait`` gives its exit code as
    ``Popen.returncode`` does (``-signum`` when a signal ended it)."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server, self.pid = server, pid
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            status = self.server.receive("status", timeout)
            self.returncode = os.waitstatus_to_exitcode(status)
            self.server.busy = False
        return self.returncode

    def poll(self) -> int | None:
        """``Popen.poll``: the exit code if the job has ended, else None (without waiting)."""
        if self.returncode is None:
            with contextlib.suppress(TimeoutError):
                self.wait(0.001)
        return self.returncode


class _Preload:
    """The process that ran ``imports`` with environment ``env`` (see the module docstring): it forks a
    ``ForkServer`` per ``server()`` call, so jobs that run side by side (a simulated cluster's agents) each
    get a server at the cost of a fork, not of the imports again (~5-6 s of CPU)."""

    def __init__(self, imports: tuple[str, ...], env: dict[str, str]) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - the process's stderr, closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno()), *imports],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log,
            pass_fds=(theirs.fileno(),), start_new_session=True,
        )  # fmt: skip
        theirs.close()
        self.servers: list[ForkServer] = []
        self.sock.settimeout(_START_TIMEOUT)
        self.check(self.sock.recv(1 << 16))

    def check(self, msg: bytes) -> None:
        if not msg:
            self.log.seek(0)
            err = self.log.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"the fork server exited ({self.proc.wait()}): {err}")

    def server(self) -> ForkServer:
        """A new server, forked from this process."""
        self.sock.settimeout(60)
        self.sock.send(b"{}")
        msg, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 1)
        self.check(msg)
        server = ForkServer(self, socket.socket(fileno=fds[0]))
        self.servers.append(server)
        return server

    def close(self) -> None:
        for server in self.servers:
            server.sock.close()  # each server's recv ends: it exits once its job has
        self.sock.close()  # this process's recv ends: it reaps its servers and exits
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class ForkServer:
    """A server forked from a ``_Preload``: it forks one job at a time (see the module docstring)."""

    def __init__(self, preload: _Preload, sock: socket.socket) -> None:
        self.preload, self.sock = preload, sock
        self.busy = False

    def receive(self, key: str, timeout: float | None) -> int:
        self.sock.settimeout(timeout)
        msg = self.sock.recv(1 << 16)  # TimeoutError: still busy; a later spawn uses another server
        self.preload.check(msg)
        value: int = json.loads(msg)[key]
        return value

    def spawn(
        self,
        argv: list[str],
        env: dict[str, str],
        stdout: int,
        stderr: int,
        cwd: str,
        hostname: str | None,
        rank_servers: int = 0,
        ranks_for: str = "torchrun",
        stdin: int | None = None,
    ) -> Child:
        """Fork ``python argv...`` with these descriptors as its stdout and stderr (and stdin: else
        ``/dev/null``)."""
        assert not self.busy, "one job at a time per fork server"
        request = {
            "argv": argv, "env": env, "cwd": cwd, "hostname": hostname, "rank_servers": rank_servers,
            "ranks_for": ranks_for,
        }  # fmt: skip
        fds = [stdout, stderr] if stdin is None else [stdout, stderr, stdin]
        socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
        self.busy = True
        return Child(self, self.receive("pid", 60))


# The processes that ran the imports, by what they imported and the environment they ran under; each forks
# as many servers as jobs run side by side (a simulated cluster's agents): each serves one job at a time.
_preloads: dict[tuple[tuple[str, ...], frozenset[tuple[str, str]]], _Preload] = {}
# Variables that change midway through a run and that nothing a server imports reads at import (a job gets
# them in its environment all the same): pytest's per test; TORCHINDUCTOR_CACHE_DIR, which torch sets in
# the test process to its own default the first time something compiles and reads only when it compiles;
# the object-store credentials and emulator host the store fixtures set (read by the store clients, which
# safepoint imports only when a URL root is opened). Each started a second server per pytest process
# (~6 s of CPU). Every other variable keys the server.
_PER_TEST = (
    "PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
    "AWS_DEFAULT_REGION", "STORAGE_EMULATOR_HOST",
)  # fmt: skip


def spawn(
    imports: tuple[str, ...],
    argv: list[str],
    env: dict[str, str],
    stdout: int,
    stderr: int,
    cwd: str,
    *,
    per_run: tuple[str, ...] = (),
    hostname: str | None = None,
    server_env: dict[str, str] | None = None,
    rank_servers: int = 0,
    ranks_for: str = "torchrun",
    stdin: int | None = None,
) -> Child:
    """Fork ``python argv...`` from a server that ran ``imports`` under this environment (started on
    first use, kept for the rest of the pytest process; while every such server is busy with a job, another
    is forked from the process that ran the imports).

    ``per_run``: variables of ``env`` that nothing reads when ``imports`` run (only the job reads them, e.g.
    a torchrun agent's workers): they do not key the server, so jobs differing only in them share one.
    ``server_env``: variables set for the server's imports only (the child gets ``env``), e.g.
    ``OMP_NUM_THREADS=1`` for a torchrun agent whose ranks use the job's own setting.
    ``hostname``: the child gets a UTS namespace of its own with this host name (as ``unshare --uts``).
    ``rank_servers``: the child is a torchrun agent (``-m torch.distributed.run``) whose first this many
    local ranks are forked from rank servers (see ``_fork_ranks``), not started as fresh interpreters;
    ``ranks_for="lightning"``: the child is a Lightning job's rank 0, and this many of the ranks Lightning
    starts itself (``Popen([python, SCRIPT, ...])``) are forked the same way."""
    fresh = {k: v for k, v in env.items() if k not in _PER_TEST and k not in per_run}
    fresh.update(server_env or {})
    key = (imports, frozenset(fresh.items()))
    preload = _preloads.get(key)
    if preload is not None and preload.proc.poll() is not None:
        del _preloads[key]
        preload.close()
        preload = None
    if preload is None:
        preload = _preloads[key] = _Preload(imports, fresh)
    server = next((s for s in preload.servers if not s.busy), None)
    if server is None:  # busy ones stay: their jobs still report to them
        server = preload.server()
    return server.spawn(argv, env, stdout, stderr, cwd, hostname, rank_servers, ranks_for, stdin)


def run(
    imports: tuple[str, ...], argv: list[str], env: dict[str, str], timeout: float, cwd: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([python, *argv], capture_output=True, text=True)``, the process forked from a
    server that ran ``imports``."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = spawn(imports, argv, env, out.fileno(), err.fileno(), cwd or os.getcwd())
        try:
            code = child.wait(timeout)
        finally:
            if child.returncode is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(
            [sys.executable, *argv], code, out.read().decode(), err.read().decode()
        )


@atexit.register
def _close_all() -> None:
    for preload in _preloads.values():
        preload.close()
    _preloads.clear()


if __name__ == "__main__":
    main()
