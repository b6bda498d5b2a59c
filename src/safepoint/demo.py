"""``safepoint demo``: train, get killed with SIGKILL partway, restart, resume, and prove the final weights
are bitwise identical to a run that was never interrupted.

The worker is a real separate process (``python -m safepoint.demo --worker``) so the kill is a real kill.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

import safepoint

console = Console()
_VOCAB, _DIM, _SEQ = 64, 32, 16


class TinyTransformer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(_VOCAB, _DIM)
        layer = torch.nn.TransformerEncoderLayer(
            _DIM, nhead=4, dim_feedforward=64, dropout=0.1, batch_first=True
        )
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(_DIM, _VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.encoder(self.embed(x)))
        return out


def _batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    # Generated data: predict the next token of a noisy arithmetic sequence.
    start = torch.randint(0, _VOCAB, (8, 1), generator=gen)
    seq = (start + torch.arange(_SEQ + 1)) % _VOCAB
    return seq[:, :-1], seq[:, 1:]


def worker(root: str, steps: int, kill_at: int | None, out: str, save_every: int) -> None:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    gen = torch.Generator().manual_seed(1)
    data = _GenState(gen)
    state = safepoint.TrainState(model=model, optimizer=opt, scheduler=sched, extra={"data": data})
    with safepoint.CheckpointManager(root, save_every_steps=save_every, keep_last=2) as mgr:
        step = mgr.restore(state)
        if step:
            print(f"RESUMED {step}", flush=True)
        while step < steps:
            x, y = _batch(gen)
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            sched.step()
            step += 1
            if mgr.maybe_save(step, state, metrics={"loss": loss.detach()}):
                print(f"SAVED {step} {mgr.saves[-1].blocking_s * 1000:.1f}", flush=True)
            if kill_at is not None and step == kill_at:
                print(f"KILLED {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    torch.save(model.state_dict(), out)


class _GenState:
    """The data generator's position is training state too."""

    def __init__(self, gen: torch.Generator) -> None:
        self.gen = gen

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.gen.set_state(sd["gen"])


def _run(args: list[str]) -> tuple[int, list[str]]:
    proc = subprocess.run(
        [sys.executable, "-m", "safepoint.demo", "--worker", *args], capture_output=True, text=True
    )
    if proc.returncode not in (0, -signal.SIGKILL):
        console.print(proc.stderr)
        raise SystemExit(f"demo worker failed with exit code {proc.returncode}")
    return proc.returncode, proc.stdout.splitlines()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="safepoint demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-at", type=int, default=37, help="step at which the run SIGKILLs itself")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--out", default="demo-out", help="directory for checkpoints and results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--final", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a.root, a.steps, a.kill_at if a.kill_at >= 0 else None, a.final, a.save_every)
        return 0
    if not 0 < a.kill_at < a.steps:
        p.error("--kill-at must be between 1 and --steps - 1")
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    common = ["--steps", str(a.steps), "--save-every", str(a.save_every)]
    t0 = time.perf_counter()
    console.print(f"[bold]1.[/] reference run: {a.steps} steps, never interrupted")
    with tempfile.TemporaryDirectory() as ref_root:
        _run([*common, "--root", ref_root, "--kill-at", "-1", "--final", str(out / "reference.pt")])
    console.print(
        f"[bold]2.[/] faulty run: SIGKILL at step {a.kill_at}, checkpoints every {a.save_every} steps"
    )
    root = out / "checkpoints"
    code, lines1 = _run(
        [*common, "--root", str(root), "--kill-at", str(a.kill_at), "--final", str(out / "final.pt")]
    )
    killed = code == -signal.SIGKILL
    console.print(f"   worker exit: {'SIGKILL' if killed else code}")
    console.print("[bold]3.[/] restart: the same command, resuming from the newest intact checkpoint")
    _, lines2 = _run([*common, "--root", str(root), "--kill-at", "-1", "--final", str(out / "final.pt")])
    resumed = next((int(ln.split()[1]) for ln in lines2 if ln.startswith("RESUMED")), 0)
    saves = [ln.split() for ln in lines1 + lines2 if ln.startswith("SAVED")]
    ref = torch.load(out / "reference.pt", weights_only=True)
    got = torch.load(out / "final.pt", weights_only=True)
    identical = ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)

    table = Table(title="safepoint demo")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("steps", str(a.steps))
    table.add_row("killed at step (SIGKILL)", str(a.kill_at) if killed else "no")
    table.add_row("resumed from step", str(resumed))
    table.add_row("steps recomputed", str(a.kill_at - resumed))
    table.add_row("saves", str(len(saves)))
    ms = sorted(float(s[2]) for s in saves)
    table.add_row("median save (ms)", f"{ms[len(ms) // 2]:.1f}" if ms else "-")
    table.add_row("committed checkpoints", ", ".join(str(c.step) for c in _list(root)))
    table.add_row("wall time (s)", f"{time.perf_counter() - t0:.1f}")
    console.print(table)
    if identical and killed and resumed > 0:
        console.print("[bold green]VERDICT: final weights are bitwise identical to the uninterrupted run[/]")
        return 0
    console.print("[bold red]VERDICT: final weights DIFFER from the uninterrupted run[/]")
    return 1


def _list(root: Path) -> list[safepoint.CheckpointInfo]:
    from safepoint.layout import Layout

    layout = Layout(root)
    return [layout.info(s, layout.read_manifest(s)) for s in layout.committed_steps()]


if __name__ == "__main__":
    sys.exit(main())
