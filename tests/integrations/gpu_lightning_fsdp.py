"""SafepointCallback under Lightning's FSDPStrategy on one GPU (NCCL, world size 1), with Lightning's own
FSDP wrap and NCCL. Lightning refuses FSDPStrategy on the CPU, and its wrap passes FSDP1 no CPU device, so
this runs where a GPU is (not in the suite); the suite runs FSDPStrategy on two CPU ranks through a subclass
and the job's own wrap (tests/integrations/test_lightning_ranks.py).

    PYTHONPATH=src python tests/integrations/gpu_lightning_fsdp.py [--workdir DIR] [--strategies LIST]

On the GPU machine (torch and lightning from the image; the wheels it lacks, crc32c, from .whl/ as in
benchmarks/gpu_check.sh):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=$PWD/src:$PWD:/tmp/site timeout 400 python3 tests/integrations/gpu_lightning_fsdp.py

It takes about a minute a strategy (9 short Lightning launches in all).

For ``FSDPStrategy(state_dict_type="sharded")``, ``FSDPStrategy(state_dict_type="full")`` and
``ModelParallelStrategy`` (FSDP2), each in its own processes: an uninterrupted run of 8 steps; a run on
another root killed with kill -9 once it printed step 5 (sync saves every 2 steps); the restart on that root.
Checked: the restart begins at the newest committed step + 1, every loss equals the uninterrupted run's bit
for bit, the gathered weights and optimizer state at the end are equal bit for bit, and ``safepoint verify
--all`` passes. Prints each check; exits 0 only if all hold.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

STEPS, KILL_AT = 8, 5
LINE = re.compile(r"step (\d+) loss (\S+)\Z")
STRATEGIES = ("fsdp-sharded", "fsdp-full", "mp")
ACCELERATOR = ["cuda"]  # --accelerator cpu: only "mp" runs there (a check of this script itself)


def child(strategy: str, root: str, out: str, sleep: float, accelerator: str) -> None:
    """One training run (this process is the job)."""
    import time

    import lightning as L
    import torch
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, TensorDataset

    import safepoint
    from safepoint.integrations.lightning import SafepointCallback

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.3), nn.Linear(64, 1))

        def configure_model(self) -> None:
            if strategy == "mp":
                fully_shard(self.net[0], mesh=self.device_mesh["data_parallel"])
                fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def train_dataloader(self) -> DataLoader[Any]:
            g = torch.Generator().manual_seed(0)
            data = TensorDataset(torch.randn(24, 8, generator=g), torch.randn(24, 1, generator=g))
            return DataLoader(data, batch_size=4, sampler=safepoint.ResumableSampler(24, seed=0))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            print(f"step {self.global_step + 1} loss {loss.item()!r}", flush=True)
            time.sleep(sleep)
            return loss

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def on_fit_end(self) -> None:
            full = StateDictOptions(full_state_dict=True, cpu_offload=True)
            weights, optim = get_state_dict(
                self.trainer.strategy.model, self.trainer.optimizers, options=full
            )
            torch.save({"model": weights, "optim": optim}, out)

    if strategy == "mp":
        strat: Any = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    else:
        strat = FSDPStrategy(state_dict_type=strategy.split("-")[1])
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        max_steps=STEPS, accelerator=accelerator, devices=1, strategy=strat, use_distributed_sampler=False,
        callbacks=[SafepointCallback(root, save_every_steps=2)], enable_checkpointing=False, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Net())
    if strategy != "mp":
        assert isinstance(trainer.strategy, FSDPStrategy)


def run(strategy: str, root: Path, out: Path, kill_at: int | None = None) -> tuple[dict[int, str], int]:
    sleep = "0.3" if kill_at else "0"
    cmd = [sys.executable, __file__, "--child", strategy, str(root), str(out), sleep, ACCELERATOR[0]]
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    assert proc.stdout is not None
    losses: dict[int, str] = {}
    for line in proc.stdout:
        m = LINE.match(line.strip())
        if m:
            losses[int(m.group(1))] = m.group(2)
            if int(m.group(1)) == kill_at:
                os.killpg(proc.pid, signal.SIGKILL)
    return losses, proc.wait(timeout=600)


def same_state(a: Path, b: Path) -> bool:
    import torch
    from torch.utils._pytree import tree_flatten

    (fa, sa), (fb, sb) = (tree_flatten(torch.load(p, weights_only=True)) for p in (a, b))
    return sa == sb and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(fa, fb, strict=True)
    )


def check(strategy: str, work: Path) -> list[str]:
    from safepoint.cli.main import main as safepoint_cli

    failed: list[str] = []

    def expect(ok: bool, what: str) -> None:
        print(f"  [{'ok' if ok else 'FAILED'}] {what}", flush=True)
        if not ok:
            failed.append(f"{strategy}: {what}")

    print(f"{strategy}:", flush=True)
    ref, code = run(strategy, work / "ref", work / "ref.pt")
    expect(code == 0 and sorted(ref) == list(range(1, STEPS + 1)), f"uninterrupted run: exit {code}, steps")
    root = work / "ckpt"
    killed, code = run(strategy, root, work / "killed.pt", kill_at=KILL_AT)
    committed = sorted(int(p.name[5:]) for p in root.glob("step-*") if (p / "safepoint.json").is_file())
    expect(code == -signal.SIGKILL and bool(committed), f"kill -9 at step {KILL_AT}: committed {committed}")
    newest = committed[-1] if committed else 0
    resumed, code = run(strategy, root, work / "resumed.pt")
    expect(code == 0, f"restart: exit {code}")
    expect(sorted(resumed) == list(range(newest + 1, STEPS + 1)), f"restart resumed at step {newest + 1}")
    different = sorted(s for s, v in (killed | resumed).items() if ref.get(s) != v)
    expect(not different, f"losses equal the uninterrupted run's bit for bit (differ: {different})")
    expect(same_state(work / "ref.pt", work / "resumed.pt"), "final weights + optimizer state bitwise equal")
    expect(safepoint_cli(["verify", str(root), "--all"]) == 0, "safepoint verify --all")
    return failed


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        strategy, root, out, sleep, accelerator = sys.argv[2:7]
        child(strategy, root, out, float(sleep), accelerator)
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--accelerator", default="cuda", help="cpu: runs only --strategies mp (checks the script)")
    args = p.parse_args()
    ACCELERATOR[0] = args.accelerator
    import lightning
    import torch

    gpu = torch.cuda.get_device_name() if args.accelerator == "cuda" else "cpu"
    print(f"torch {torch.__version__}, lightning {lightning.__version__}, {gpu}", flush=True)
    failed: list[str] = []
    with tempfile.TemporaryDirectory(dir=args.workdir or None) as tmp:
        for strategy in args.strategies.split(","):
            (Path(tmp) / strategy).mkdir()
            failed += check(strategy, Path(tmp) / strategy)
    print("FAILED:\n  " + "\n  ".join(failed) if failed else "all checks passed", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
