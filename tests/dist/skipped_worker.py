"""A 2-rank job for tests/dist/test_bytes_skipped.py: each rank holds frozen bytes of its own (its own keys,
so each rank writes and links its own files) and a tensor that changes; argv: root, out (JSON)."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import safepoint
from tests.helpers.procs.exiting import run_then_exit


def main() -> None:
    root, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = torch.nn.Module()
    # Rank r's frozen tensor is (r + 1) * 64 KiB: the ranks link different amounts.
    model.register_parameter(
        f"frozen{rank}", torch.nn.Parameter(torch.randn((rank + 1) * 16384), requires_grad=False)
    )
    model.register_parameter(f"moving{rank}", torch.nn.Parameter(torch.zeros(8)))
    events: list[dict[str, object]] = []

    def on_event(e: safepoint.CheckpointEvent) -> None:
        if e.event_type in ("save_written", "save_committed"):
            events.append({"kind": e.event_type, "step": e.step, "skipped": e.bytes_skipped})

    with safepoint.CheckpointManager(root, on_event=on_event) as mgr:
        for step in (1, 2, 3):
            with torch.no_grad():
                getattr(model, f"moving{rank}").add_(1.0)
            mgr.save(step, safepoint.TrainState(model=model, rng=False))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(events, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_then_exit(main)  # never through the interpreter's teardown (tests/helpers/procs/exiting.py)
