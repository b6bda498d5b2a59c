"""The training thread's save first: background save work parks while a save runs beside it.

With ``WriterOptions(if_busy="auto")`` a save that finds the previous one still writing is written
synchronously by the training thread, beside the one in flight. Measured (docs/benchmarks.md, round 6),
that save blocked up to ~2.8x a sync save of the same state, though its own CPU was a sync save's: the
in-flight save's Python work in this process (its writer thread's planning, ``.metadata``, commit, and the
retention thread's pass) ran at the same time and took the GIL at every system call the training thread's
save made (and held it up to the 5 ms switch interval, or longer when the nice-10 writer thread holding it
was itself waiting for a core on a loaded node: a priority inversion nice cannot undo). So the save the
loop waits for ran at a fraction of its speed, whichever writer (thread or process) the async save used.

The gate removes that: while the training thread writes such a save, the background threads stop at their
next *pause point* and wait, holding the GIL no longer (``threading.Event.wait`` releases it). The pause
points lie where the waiting thread holds no lock the training thread's save could need: between the
phases of the background save (save/saver.py), at the start of the writer thread, before it frees what
the async save's blocking part made (save/background.py), before each file it creates
(store/storage.py), after the writer process's answer (save/process_writer.py) and before a background
retention pass (policy/retainer.py). What the background save does meanwhile is not lost, only deferred:
its bytes, its commit and its guarantees are the same, it finishes once the training thread's save has
returned. The writer process itself is not stopped: it has its own interpreter (no GIL) and runs at a
lower priority.

A thread never parks on its own gate (the training thread may run a retention pass inline, which passes
the same pause point), and the gate is released on any exit from the foreground save.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


def no_pause() -> None:
    """The pause point of a save with no gate (every sync saver; an async one without "auto")."""


class ForegroundGate:
    """Held by the training thread while it writes a save beside a background one; the background work
    waits at its pause points meanwhile."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self._holder: int | None = None  # the thread id of the foreground save
        self._depth = 0  # nested holds by that thread (the gate opens when the outermost ends)
        self.parked = 0
        """How many times a background thread waited at a pause point for a foreground save (tests)."""
        self.held = 0
        """How many foreground saves held the gate."""

    @contextmanager
    def foreground(self) -> Iterator[None]:
        """Background work parks at its next pause point until the block ends (any exit). One thread (the
        training thread) holds it, possibly nested."""
        me = threading.get_ident()
        assert self._holder in (None, me), "the gate is held by one thread at a time"
        self._holder, self._depth = me, self._depth + 1
        self.held += 1
        self._open.clear()
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._holder = None
                self._open.set()

    @contextmanager
    def opened(self) -> Iterator[None]:
        """For the holder's waits on background work (which cannot finish while parked): the gate open
        for the block. No such wait happens today (a save waits for the one in flight before it takes the
        gate); this keeps one added later from hanging."""
        if self._holder != threading.get_ident():
            yield
            return
        self._open.set()
        try:
            yield
        finally:
            self._open.clear()

    def pause(self) -> None:
        """A pause point: wait while a foreground save runs (unless this thread is the one running it)."""
        if self._open.is_set() or self._holder == threading.get_ident():
            return
        self.parked += 1
        self._open.wait()
