"""A training process that saves every step; the parent SIGKILLs it at random points.

Every tensor of step N's state is filled with the value N, so a restored checkpoint can be checked to hold
exactly one step's state (never a mix, never a torn file).
Prints "BEGIN <step>" / "END <step>" around each save so the parent can aim its kills (with async saves,
END comes once the state is staged: the previous save's write runs meanwhile).
"""

from __future__ import annotations

import sys

import torch

import safepoint


def main() -> None:
    root, start = sys.argv[1], int(sys.argv[2])
    # "async": async saves through a writer process per rank (asked for: "auto" writes a state this small
    # with the thread), killed mid-write too.
    async_save = sys.argv[3:] == ["async"]
    writer = safepoint.WriterOptions(async_writer="process") if async_save else None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))  # ~2 MB of params
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(1, 256)).sum().backward()
    opt.step()
    extra: dict[str, object] = {"step": 0}
    state = safepoint.TrainState(model=model, optimizer=opt, extra=extra)
    with safepoint.CheckpointManager(
        root,
        save_every_steps=1,
        async_save=async_save,
        writer=writer,
        keep=safepoint.Keep(last=2, every_steps=5),
    ) as mgr:
        restored = mgr.restore(state)
        for step in range(restored + 1, start + 1000):
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(step)
                for st in opt.state.values():
                    st["exp_avg"].fill_(step)
                    st["exp_avg_sq"].fill_(step)
            extra["step"] = step
            print(f"BEGIN {step}", flush=True)
            mgr.maybe_save(step, state)
            print(f"END {step}", flush=True)


if __name__ == "__main__":
    main()
