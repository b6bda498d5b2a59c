"""Hold the cyclic garbage collector off while a save or a restore does its per-item work.

Why: a save or restore of N tensors allocates tens of short-lived objects per item (DCP's write and read
items, indices, results, the pickled or unpickled metadata) while DCP's plan cache keeps ~18 objects per
item alive for as long as the saver lives (~720,000 for 10,000 parameters with Adam). Every 700 net
allocations the collector runs, and every so often a full collection walks that whole heap: 21% of a
steady save's CPU and 32% of a first save's at 10,000 parameters (issue 27's profile), and 1.5 s of a
10,000-parameter restore. The collector finds nothing there: those objects die by reference count (none
form cycles), or live on in the cache. Holding it off costs at most the cyclic garbage the rest of the
process makes meanwhile, which the first collection after the pause frees (its allocation count kept
growing during the pause, so one comes soon).

The switch is process-wide (``gc.disable``): an async save's writer thread holds it off for the training
thread too, for that save's duration only. Nested and concurrent pauses are counted; the last one out
turns the collector back on, and only if it was on when the first one came in (a program that runs with
the collector off keeps it off).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic collection inside the block (counted across threads); restored on any exit."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
