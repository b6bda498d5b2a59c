"""How a torchrun worker of the test suite ends: ``exit_now()`` after its last collective.

torch 2.13 keeps a DDP or FSDP2 job's gloo group alive past ``destroy_process_group`` (the reducer, DeviceMesh
and DTensor's caches hold it), so its worker threads outlive the script. ``dist.barrier()`` makes it worse:
the barrier's work keeps every earlier work, with the tensors Python gave them, until a worker thread drops
it, which can be after the barrier returned. A thread that drops the last reference to such a tensor takes
the GIL; if the interpreter is finalizing by then, CPython ends that thread with ``pthread_exit``, whose
unwinding through torch's noexcept destructor aborts the process: SIGABRT, "terminate called without an
active exception" (pytorch/pytorch#190489). CI failed once on it in tests/dist/test_nodes.py; a core dump
showed ``ProcessGroupGloo::runLoop`` -> ``~AsyncBarrierWork`` -> ``~AsyncAllgatherCoalescedWork`` ->
``decref`` -> ``take_gil`` -> ``pthread_exit`` while the main thread ran the final garbage collection.

Nothing is left to do after the last collective, so the teardown is skipped; ``atexit`` handlers still run,
while the interpreter is whole (tests/dist/test_exit.py reproduces the abort and checks this way out).
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def exit_now(code: int = 0) -> NoReturn:
    """Run the ``atexit`` handlers, flush stdout and stderr, and end the process with ``code`` without the
    interpreter's teardown."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
