"""shield: DataLoader workers survive the preemption signal their rank is saving on.

torchrun's agent stops a rank with ``killpg`` (every process of the rank's group), Slurm signals every
process of the job step, and a shell's ``kill -- -PGID`` does the same: a DataLoader's worker processes get
the SIGTERM at the same moment as the rank. PyTorch's worker handler then dies of it, and the rank's SIGCHLD
handler raises ``RuntimeError: DataLoader worker (pid N) is killed by signal: Terminated`` at whatever
bytecode the rank was running (inside ``backward`` in our reproduction), before ``maybe_save`` can save.

A shielded worker blocks the preemption signals and waits for them in a thread of its own, which reads the
sender (``sigwaitinfo``): from its parent (the loader shutting down, or multiprocessing's exit handler,
which ``terminate()`` their daemonic children) the worker exits at once, as PyTorch's own handler does for
its parent; from anyone else (the agent, slurmstepd) it is ignored, and the worker goes on serving batches
to the emergency save's step. Simply ignoring SIGTERM in workers instead would make ``terminate()`` a no-op
and hang every rank at exit until the agent's SIGKILL. With ``PR_SET_PDEATHSIG`` the worker also dies with
the rank if the rank is killed outright.

SIGTERM does not queue, though: if the waiter has not yet taken the group's SIGTERM when the parent's
``terminate()`` comes (a thread left unscheduled for the length of a short save, under load), the second
merges into the first, ``sigwaitinfo`` reports only the foreign sender, and the rank's exit handler joins
the worker forever. So a forked worker also waits for :data:`RELEASE`, a real-time signal (those queue,
one per send), and the rank sends it, at exit, to each of its multiprocessing children whose mask blocks it
(its shielded workers; to any other process its default action would kill), from a multiprocessing
finalizer: ``multiprocessing``'s exit handler runs it before it ``terminate()``s and joins the children,
in the main process (at ``atexit``) and in a rank that is itself a multiprocessing child alike.

Applied by default: while a manager with preemption signals is open, every child forked by a DataLoader
(``torch.utils.data`` or ``torchdata``, found on the forking call stack) is shielded from those signals.
Loaders started with ``multiprocessing_context="spawn"`` or ``"forkserver"`` do not fork from the rank:
pass ``worker_init_fn=safepoint.shield_worker_init(...)`` for them. Such a worker already runs a native
thread when its init function runs, which the mask cannot cover, so it also leaves the rank's process group:
it is safe from group signals (torchrun, ``kill -- -PGID``), not from a signal sent to each process. Nor
does it wait for :data:`RELEASE` (that native thread would die of it): out of the group, no foreign SIGTERM
is pending when its parent's comes.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import multiprocessing
import multiprocessing.util
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable

_LOADER_MODULES = ("torch.utils.data", "torchdata")
_PR_SET_PDEATHSIG = 1

_active: list[frozenset[signal.Signals]] = []
"""The signal sets of the open managers that shield (a process may hold more than one manager)."""
_hook_installed = False
_shielded_in: int | None = None
"""The pid of the process shielded already (the fork hook and a ``shield_worker_init`` may both run)."""
_forked_on_main_thread = True
"""Set in the parent right before each fork: PR_SET_PDEATHSIG fires when the *thread* that forked exits."""
_RTMIN: int | None = getattr(signal, "SIGRTMIN", None)
RELEASE: int | None = None if _RTMIN is None else int(_RTMIN) + 5
"""The rank's "exit now" to its shielded workers at its exit: real-time, so it cannot merge into a pending
foreign SIGTERM as a second SIGTERM does (see the module docstring). None where there are no real-time
signals."""
_release_in: int | None = None
"""The pid of the process whose exit releases its shielded workers (a forked child inherits this module)."""


def activate(signals: Iterable[signal.Signals]) -> frozenset[signal.Signals]:
    """Shield the DataLoader workers forked from now on (until :func:`deactivate` with the same set)."""
    global _hook_installed, _release_in
    token = frozenset(signals)
    if not _hook_installed and hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _hook_installed = True
    if _release_in != os.getpid() and RELEASE is not None:
        # Not deactivated with the manager: workers forked while it was open may outlive it (a loader's
        # iterator held at top level), and they are the ones multiprocessing's exit handler stops.
        multiprocessing.util.Finalize(None, _release_workers, exitpriority=0)
        _release_in = os.getpid()
    _active.append(token)
    return token


def deactivate(token: frozenset[signal.Signals]) -> None:
    if token in _active:
        _active.remove(token)


def _before_fork() -> None:
    global _forked_on_main_thread
    _forked_on_main_thread = threading.current_thread() is threading.main_thread()


def _after_fork_in_child() -> None:
    if not _active:
        return
    signals = frozenset().union(*_active)
    _active.clear()  # this child holds no manager: its own children are not shielded on its behalf
    if _forked_by_a_loader():
        shield(signals, exit_with_parent=_forked_on_main_thread)


def _forked_by_a_loader() -> bool:
    """Whether the fork was called from a DataLoader (the child's stack is the parent's, copied)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if isinstance(name, str) and name.startswith(_LOADER_MODULES):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def shield(signals: Iterable[int | signal.Signals], *, exit_with_parent: bool = True) -> None:
    """In a worker process: survive ``signals`` unless the parent sends them; see the module docstring."""
    global _shielded_in
    if _shielded_in == os.getpid():
        return
    _shielded_in = os.getpid()
    sigs: set[int] = {signal.Signals(s) for s in signals}
    parent = os.getppid()
    # Alone (a forked worker), the mask set now covers every thread this process will have. Otherwise (a
    # spawned worker: importing torch started a native thread) it cannot cover the threads already running.
    alone = _single_threaded()
    if alone and RELEASE is not None:
        sigs.add(RELEASE)
    # Blocked before the waiter starts, so every thread (the waiter included) inherits the mask and the
    # signal stays pending until sigwaitinfo takes it: no handler (PyTorch's included) ever runs for it.
    signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    if exit_with_parent and sys.platform == "linux":
        _set_pdeathsig(signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl: the death signal never comes
            os._exit(1)
    if not alone:
        # A process-directed signal goes to any thread that does not block it: the native thread would run
        # PyTorch's handler. Leave the signalled process group instead (torchrun's killpg and
        # ``kill -- -PGID`` miss the worker; a per-process signal, as Slurm's at the time limit, still
        # reaches it). Out of the group, no foreign SIGTERM is pending when the parent's comes either.
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
    threading.Thread(target=_wait, args=(sigs, parent), name="safepoint-shield", daemon=True).start()


def _single_threaded() -> bool:
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return threading.active_count() == 1


def _release_workers() -> None:
    """At the rank's exit, before multiprocessing's exit handler ``terminate()``s and joins its children."""
    if _release_in != os.getpid() or RELEASE is None:
        return
    bit = 1 << (RELEASE - 1)
    for child in multiprocessing.active_children():
        # Only a child that blocks RELEASE is waiting for it (a shielded worker); it would kill any other.
        # An unreaped child's pid cannot be reused, so the pid read is the pid signalled.
        if child.pid is not None and _blocked(child.pid) & bit:
            with contextlib.suppress(OSError):
                os.kill(child.pid, RELEASE)


def _blocked(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
    except (OSError, StopIteration, ValueError):
        return 0


def _wait(sigs: set[int], parent: int) -> None:
    while True:
        # SIGTERM from the parent, or RELEASE: it queues, so it is read even when the parent's SIGTERM
        # merged into a pending foreign one (the first sender is all sigwaitinfo reports of a merge).
        info = signal.sigwaitinfo(sigs)
        if info.si_pid == parent or os.getppid() != parent:
            # The parent's terminate() (loader shutdown, multiprocessing's exit handler): exit at once and
            # quietly, as PyTorch's worker handler does for its parent. Flushing nothing: a worker owns no
            # state the rank needs.
            os._exit(0)


def _set_pdeathsig(sig: signal.Signals) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the loader's own watchdog still ends orphaned workers
        pass


@dataclasses.dataclass(frozen=True, slots=True)
class ShieldedWorkerInit:
    """A picklable ``worker_init_fn`` (spawn and forkserver loaders pickle it): shield, then call ``fn``."""

    signals: tuple[int, ...]
    """The signals the worker survives unless its parent sends them."""
    fn: Callable[[int], object] | None = None
    """The loader's own ``worker_init_fn``, called after the shield with the worker id."""

    def __call__(self, worker_id: int) -> None:
        shield(self.signals)
        if self.fn is not None:
            self.fn(worker_id)


def shield_worker_init(
    fn: Callable[[int], object] | None = None,
    signals: Iterable[int | signal.Signals] = (signal.SIGTERM,),
) -> ShieldedWorkerInit:
    """``DataLoader(..., worker_init_fn=safepoint.shield_worker_init(my_init))``: needed only for loaders
    that do not fork (``multiprocessing_context="spawn"``/``"forkserver"``); forked ones are shielded by
    the manager already. ``signals``: the manager's ``PreemptionOptions.signals``."""
    sigs = tuple(int(signal.Signals(s)) for s in signals)
    if not sigs:
        raise ValueError("shield_worker_init: signals is empty")
    if fn is not None and not callable(fn):
        raise ValueError(f"shield_worker_init: fn must be callable, got {fn!r}")
    return ShieldedWorkerInit(sigs, fn)
