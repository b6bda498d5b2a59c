"""A training job for tests/save/test_incremental_restart.py: a frozen base and a trained adapter, a save
per step. ``python -m tests.save._restart_job ROOT LAST [sync|async] [hang] [tamper]``: restores (tamper: then damages the base's file in the
restored step), trains and saves
up to step LAST, then (hang) prints HANG and sleeps until killed, or exits. Prints each save's
``bytes_skipped`` as "skipped STEP N"."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import safepoint
from safepoint.store.storage import read_metadata_file

FROZEN = 256 * 1024  # floats: 1 MiB


class Job(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Parameter(torch.randn(FROZEN), requires_grad=False)
        self.register_buffer("table", torch.randn(FROZEN // 4))
        self.adapter = nn.Linear(16, 16)


def _flip_a_byte_of_the_base(step_dir: Path) -> None:
    """Damage the file holding ``model.base`` in the step just restored (after the restore read it)."""
    md = read_metadata_file(step_dir / ".metadata")
    [name] = {info.relative_path for idx, info in md.storage_data.items() if idx.fqn == "model.base"}
    with open(step_dir / name, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))


def main() -> None:
    root, last, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.manual_seed(1234)  # the same initial state in every process: the restore must overwrite it
    model = Job()
    opt = torch.optim.AdamW(model.adapter.parameters())
    state = safepoint.TrainState(model=model, optimizer=opt)

    def on_event(e: safepoint.CheckpointEvent) -> None:
        if e.event_type == "save_committed":
            print(f"skipped {e.step} {e.bytes_skipped}", flush=True)

    with safepoint.CheckpointManager(
        root,
        keep=safepoint.Keep(last=5),
        async_save=mode == "async",
        writer=safepoint.WriterOptions(full_every=0),
        on_event=on_event,
    ) as mgr:
        step = mgr.restore(state)
        if "tamper" in sys.argv[4:]:
            _flip_a_byte_of_the_base(Path(root) / f"step-{step}")
        while step < last:
            model.adapter(torch.randn(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            step += 1
            mgr.save(step, state)
            mgr.wait()
        if "hang" in sys.argv[4:]:
            print("HANG", flush=True)
            time.sleep(600)


if __name__ == "__main__":
    main()
