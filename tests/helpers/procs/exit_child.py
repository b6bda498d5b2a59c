"""A gloo process that ends while its group's thread still holds the last reference to a tensor Python gave
it (the shape of pytorch/pytorch#190489, tests/helpers/procs/exiting.py):

    python exit_child.py STORE_FILE MARK_FILE (exit_now|teardown)

``exit_now``: it ends through ``exit_now(7)``, with a non-daemon thread still finishing, an ``atexit`` handler
(which writes MARK_FILE) and unflushed output. ``teardown``: no collective, a plain end (the witness's
control). Either way a module-level witness writes "teardown" to stderr if the interpreter's teardown runs.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tests.helpers.procs.exiting import exit_now


class Witness:
    """Freed with the module's globals, which only the interpreter's teardown does."""

    write = staticmethod(os.write)  # os itself may be torn down by then

    def __del__(self) -> None:
        self.write(2, b"teardown\n")


witness = Witness()
store_file, mark, how = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", store=dist.FileStore(store_file, 1), rank=0, world_size=1)
if how == "exit_now":
    atexit.register(lambda: mark.write_text(mark.read_text() + "atexit ran"))
    threading.Thread(target=lambda: (time.sleep(0.5), mark.write_text("thread joined, "))).start()
    sys.setswitchinterval(100)  # this thread keeps the GIL: gloo's thread, done with the work, waits for it
    tensor = torch.ones(1 << 22)
    work = dist.all_reduce(tensor, async_op=True)
    del tensor, work  # the tensor's last reference is the work's, in gloo's thread
    print("ending", end="")  # no newline: still buffered when the process ends
    exit_now(7)
