"""A check run in a forked child of the test process, alone: no thread of the pytest worker but the caller's,
and whatever the check changes process-wide (the cyclic collector's view, the open-file limit) gone with it."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable


def alone_in_a_fork(check: Callable[[], str]) -> str:
    """``check()`` in a forked child, which has this thread and no other; its answer comes back by pipe.

    The collector is process-wide: in a pytest worker, threads left by earlier tests (fsspec's event loop
    closing an earlier store's idle aiohttp connections, an emulator's server threads) make cyclic garbage
    of their own while a test runs (a whole-suite run once found 2,903 objects that staging did not make).
    A fork copies only the calling thread, so whatever the child's collector finds, the check made.
    """
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            # What the worker made before the fork is frozen out of the collector's sight: a collection
            # would otherwise walk (and copy on write) the whole inherited heap of a long-running worker,
            # ~35 s per check late in a whole-suite run. The check's own objects are all made after this.
            gc.freeze()
            os.close(read)
            answer = check()
            os.write(write, answer.encode())
            code = 0
        except BaseException as e:  # every failure of the check goes back to the test
            os.write(write, f"{type(e).__name__}: {e}".encode())
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        answer = f.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, answer
    return answer
