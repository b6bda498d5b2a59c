"""One training process reading through a DataLoader with 2 worker processes, for
tests/preempt/test_preemption_loader.py. The test signals the whole process group (as torchrun's agent and Slurm
do), so the workers get the SIGTERM with the training process.

    python loader_term.py ROOT DIR fork|spawn shield|noshield [hold]

``hold``: the loader's iterator is kept in a global, as a script's top level keeps it, so its workers are
still running at interpreter exit and multiprocessing's exit handler stops them (``terminate()``: SIGTERM
from the parent, which a shielded worker must obey). Each worker writes its pid to ``DIR/worker.<pid>``; after 3 steps the process writes ``DIR/ready`` and
trains on (slowly) until signalled.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import safepoint

HELD: list[object] = []


def record_pid(worker_id: int) -> None:
    Path(sys.argv[2], f"worker.{os.getpid()}").touch()


def main() -> None:
    root, out, context, shield = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4] == "shield"
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    init = safepoint.shield_worker_init(record_pid) if context == "spawn" and shield else record_pid
    loader = DataLoader(
        data, batch_size=4, num_workers=2, worker_init_fn=init, multiprocessing_context=context
    )
    state = safepoint.TrainState(model=model, optimizer=opt)
    with safepoint.CheckpointManager(
        root, preemption=safepoint.PreemptionOptions(signals=(signal.SIGTERM,), shield_workers=shield)
    ) as mgr:
        step = mgr.restore(state)
        while True:
            it = iter(loader)
            if sys.argv[5:] == ["hold"]:
                HELD.append(it)
            for x, y in it:
                loss = ((model(x) - y) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                if step == 3:
                    (out / "ready").write_text(str(os.getpid()))
                time.sleep(0.01)
                mgr.maybe_save(step, state)


if __name__ == "__main__":
    main()
