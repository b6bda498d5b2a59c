"""A gloo process that ends while its group's thread still holds the last reference to a tensor Python gave
it (the shape of pytorch/pytorch#190489, tests/helpers/procs/exiting.py):

    python exit_child.py STORE_FILE MARK_FILE

It ends through ``exit_now()``; its ``atexit`` handler writes MARK_FILE and its last output is unflushed.
"""

from __future__ import annotations

import atexit
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.helpers.procs.exiting import exit_now

store_file, mark = sys.argv[1], Path(sys.argv[2])
dist.init_process_group("gloo", store=dist.FileStore(store_file, 1), rank=0, world_size=1)
atexit.register(mark.write_text, "atexit ran")
sys.setswitchinterval(100)  # this thread keeps the GIL: gloo's thread, done with the work, waits for it
tensor = torch.ones(1 << 22)
tensor.note = "a Python attribute"  # as FSDP's tensors carry
work = dist.all_reduce(tensor, async_op=True)
del tensor, work  # the tensor's last reference is the work's, in gloo's thread
print("ending", end="")  # no newline: still buffered when the process ends
exit_now(7)
