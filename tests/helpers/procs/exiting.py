"""How a torchrun worker of the test suite ends: ``run_then_exit(main)`` (or ``exit_now()`` after its last
collective), never through the interpreter's teardown.

In torch 2.13 the default gloo group often outlives ``destroy_process_group``: FSDP2's DeviceMesh and DTensor
caches hold it, and so does whatever ``torch._dynamo`` sets up when it is first imported after
``init_process_group`` (building the first ``torch.optim`` optimizer imports it, so nearly every training
script is in that case). Its worker threads then outlive the script. ``dist.barrier()`` makes it worse: the
barrier's work keeps every earlier work, with the tensors Python gave them, until a worker thread drops it,
which can be after the barrier returned. A thread that drops the last reference to such a tensor takes the
GIL; if the interpreter is finalizing by then, CPython ends that thread with ``pthread_exit``, whose
unwinding through torch's noexcept destructor aborts the process: SIGABRT, "terminate called without an
active exception" (pytorch/pytorch#190489). CI failed once on it in tests/dist/test_nodes.py; a core dump
showed ``ProcessGroupGloo::runLoop`` -> ``~AsyncBarrierWork`` -> ``~AsyncAllgatherCoalescedWork`` ->
``decref`` -> ``take_gil`` -> ``pthread_exit`` while the main thread ran the teardown's garbage collection.

What a normal exit does before its teardown still happens, in the same order: non-daemon threads are
joined, then the ``atexit`` handlers run, while the interpreter is whole. tests/dist/test_exit.py checks
this; tests/test_architecture.py checks that every torchrun worker of the suite ends this way.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


def exit_now(code: int = 0) -> NoReturn:
    """Join the non-daemon threads, run the ``atexit`` handlers, flush stdout and stderr, and end the
    process with ``code`` without the interpreter's teardown."""
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize calls first
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_then_exit(main: Callable[[], object]) -> NoReturn:
    """``main()``, then ``exit_now``: with 0, or with the status of a ``SystemExit`` that carries one
    (``safepoint.Preempted``'s 143). Any other exception propagates as usual (a traceback, exit status 1)."""
    try:
        main()
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):
            raise  # a message: Python prints it
        exit_now(e.code or 0)
    exit_now(0)
