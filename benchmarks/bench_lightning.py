"""Lightning alone vs Lightning + SafepointCallback, on the same job (examples/lightning_train.py: a tiny
causal transformer, DataLoader with 2 workers, dropout on, 12 batches an epoch).

    PYTHONPATH=src python benchmarks/bench_lightning.py [--steps 30] [--at 10]

"native" is what Lightning offers by itself: ``ModelCheckpoint(every_n_train_steps=4, save_last=True)`` and
``fit(ckpt_path="last")`` on every start. "safepoint" is the example as it is (``SafepointCallback``, async
saves). For each: an uninterrupted reference run; kill -9 of the process group after step ``--at`` and a
restart; SIGTERM to the process group after step ``--at`` and a restart; the newest checkpoint cut to half
its size and a restart. Printed: exit codes, the step each restart resumed at, how many losses differ from
the reference (bit for bit), and the training loop's blocking time per save (median, ms).
Results and the command go in docs/frameworks/lightning.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import runpy
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "lightning_train.py"
STEP = re.compile(r"^step (\d+) loss (\S+)$", re.M)
SAVE = re.compile(r"^save_ms (\S+)$", re.M)
EVERY = 4


def child(mode: str, root: str, steps: int, sleep: float) -> None:
    """One launch of the job in ``mode``; prints the example's lines and ``save_ms`` per save."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    import safepoint
    from safepoint.integrations.lightning import SafepointCallback

    ex: dict[str, Any] = runpy.run_path(str(EXAMPLE), run_name="example")
    L.seed_everything(0, verbose=False)
    dataset = ex["Tokens"]()
    loader = DataLoader(
        dataset, batch_size=ex["BATCH"], sampler=safepoint.ResumableSampler(len(dataset)), num_workers=2
    )
    if mode == "native":
        saver: Any = L.pytorch.callbacks.ModelCheckpoint(
            dirpath=root, every_n_train_steps=EVERY, save_last=True
        )
    else:
        saver = SafepointCallback(root, save_every_steps=EVERY, async_save=True)
    timed = saver.on_train_batch_end

    def on_train_batch_end(trainer: Any, *args: Any) -> None:
        t0 = time.perf_counter()
        timed(trainer, *args)
        if trainer.global_step % EVERY == 0:
            print(f"save_ms {(time.perf_counter() - t0) * 1e3:.2f}", flush=True)

    saver.on_train_batch_end = on_train_batch_end
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, callbacks=[saver], logger=False,
        enable_checkpointing=mode == "native", enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    torch.set_num_threads(1)
    trainer.fit(ex["TinyLM"](sleep), loader, ckpt_path="last" if mode == "native" else None)


def launch(
    mode: str, root: Path, steps: int, sleep: float = 0.0, kill: tuple[int, int] | None = None
) -> tuple[int, str]:
    cmd = [sys.executable, __file__, "--child", mode, str(root), str(steps), str(sleep)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = root.parent / f"{root.name}-{time.monotonic_ns()}.log"
    with out.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        if kill is not None:
            at, sig = kill
            while proc.poll() is None and at not in [int(n) for n, _ in STEP.findall(out.read_text())]:
                time.sleep(0.05)
            if proc.poll() is None:
                os.killpg(proc.pid, sig)
        code = proc.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # workers left behind, if any
    return code, out.read_text()


def losses(text: str) -> dict[int, str]:
    return {int(n): v for n, v in STEP.findall(text)}


def newest_file(mode: str, root: Path) -> Path:
    if mode == "native":
        return root / "last.ckpt"
    step = max((p for p in root.glob("step-*")), key=lambda p: int(p.name[5:]))
    return max(step.glob("*.distcp"), key=lambda p: p.stat().st_size)


def scenario(mode: str, base: Path, steps: int, at: int, ref: dict[int, str], how: str) -> str:
    root = base / f"{mode}-{how}"
    if how == "half-written":
        launch(mode, root, at)
        victim = newest_file(mode, root)
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        first_code = 0
    else:
        sig = signal.SIGKILL if how == "kill -9" else signal.SIGTERM
        first_code, _ = launch(mode, root, steps, sleep=0.25, kill=(at, sig))
    code, second = launch(mode, root, steps)
    got = losses(second)
    start = min(got) if got else None
    differ = sum(1 for s, v in got.items() if ref.get(s) != v)
    tail = second.strip().splitlines()[-1][:120] if code else ""
    return (f"| {mode} | {how} | {first_code if how != 'half-written' else '-'} | {code} | "
            f"{start} | {differ} of {len(got)} | {tail} |")  # fmt: skip


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--at", type=int, default=10)
    args = p.parse_args()
    print(f"load average {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        rows = []
        for mode in ("native", "safepoint"):
            code, text = launch(mode, base / f"{mode}-ref", args.steps)
            ref = losses(text)
            saves = [float(x) for x in SAVE.findall(text)]
            median, worst = statistics.median(saves), max(saves)
            print(f"{mode}: exit {code}, {len(ref)} steps, blocking per save {median:.1f} ms median, "
                  f"max {worst:.1f} ms over {len(saves)} saves", flush=True)  # fmt: skip
            for how in ("kill -9", "SIGTERM", "half-written"):
                rows.append(scenario(mode, base, args.steps, args.at, ref, how))
                print(rows[-1], flush=True)
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
