"""The frameworks' own checkpointing beside safepoint's, on the same job (docs/frameworks/*.md).

    PYTHONPATH=src python benchmarks/frameworks_native.py compare --out /tmp/fw     # both frameworks

The jobs are examples/accelerate_train.py and examples/hf_trainer_train.py (same model, data, seeds); the
native variants below save with ``accelerator.save_state`` (automatic naming, ``total_limit=3``) and resume
with ``load_state`` + ``skip_first_batches``, or with the Trainer's ``save_steps`` and
``train(resume_from_checkpoint=True)``. For each framework and each way of checkpointing: an uninterrupted
run; a run killed with kill -9 of its process group at step 11 (the newest checkpoint is then mid-epoch: 12
batches an epoch) and resumed (losses equal to the
uninterrupted run's?); a run sent SIGTERM at step 7 (exit code, steps lost); the blocking time of a save
(median); and a resume after the newest checkpoint's largest file was cut in half (a save killed mid-write).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STEPS, SAVE_EVERY = 20, 4


def _example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the native jobs ---------------------------------------------------------------------------------


def accelerate_native(root: str, steps: int, save_every: int, step_sleep: float) -> None:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed
    from torch import nn
    from torch.utils.data import DataLoader

    ex = _example("accelerate_train")
    config = ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True, total_limit=3)
    accelerator = Accelerator(cpu=True, project_config=config)
    set_seed(0)
    model = ex.TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=steps)
    data = DataLoader(ex.Tokens(96), batch_size=8, shuffle=True, num_workers=2)
    model, opt, data, sched = accelerator.prepare(model, opt, data, sched)
    counter = {"step": 0}

    class Step:
        def state_dict(self) -> dict[str, int]:
            return dict(counter)

        def load_state_dict(self, sd: dict[str, int]) -> None:
            counter.update(sd)

    accelerator.register_for_checkpointing(Step())
    folders = sorted(int(p.name.split("_")[1]) for p in (Path(root) / "checkpoints").glob("checkpoint_*"))
    if folders:
        accelerator.load_state()  # the newest checkpoints/checkpoint_N
        # load_state does not advance the automatic naming: without this the next save_state raises
        # "Checkpoint directory .../checkpoint_0 already exists".
        accelerator.project_configuration.iteration = folders[-1] + 1
    step = counter["step"]
    model.train()
    while step < steps:
        epoch, skip = divmod(step, len(data))
        data.set_epoch(epoch)
        batches = accelerator.skip_first_batches(data, skip) if skip else data
        for batch in batches:
            logits = model(batch[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, ex.VOCAB), batch[:, 1:].reshape(-1))
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            print(f"step {step} loss {loss.item()!r}", flush=True)
            time.sleep(step_sleep)
            if step % save_every == 0:
                counter["step"] = step
                t0 = time.perf_counter()
                accelerator.save_state()
                print(f"save {time.perf_counter() - t0}", flush=True)
            if step == steps:
                break


def trainer_native(root: str, steps: int, save_every: int, step_sleep: float) -> None:
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )

    ex = _example("hf_trainer_train")
    ex.STEP_SLEEP = step_sleep
    set_seed(0)
    config = GPT2Config(
        vocab_size=ex.VOCAB,
        n_positions=ex.SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)

    class SaveTime(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t0 = time.perf_counter()

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            print(f"save {time.perf_counter() - self.t0}", flush=True)

    args = TrainingArguments(
        output_dir=root, max_steps=steps, per_device_train_batch_size=8, learning_rate=3e-3,
        lr_scheduler_type="linear", dataloader_num_workers=2, save_strategy="steps", save_steps=save_every,
        save_total_limit=3, logging_steps=5, report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=args, train_dataset=ex.Tokens(96), callbacks=[ex.PrintLoss(model), SaveTime()]
    )
    resume = (
        any(p.name.startswith("checkpoint-") for p in Path(root).glob("*")) if Path(root).is_dir() else False
    )
    trainer.train(resume_from_checkpoint=resume or None)


# ---- the comparison ----------------------------------------------------------------------------------


def _run(
    cmd: list[str], stop_at: int | None = None, sig: int = signal.SIGKILL, sleep: float = 0.0
) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from tests.helpers.example_runs import _STEP  # the same parsing as the tests

    env = dict(os.environ, PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{REPO}", OMP_NUM_THREADS="1")
    cmd = [*cmd, "--step-sleep", str(sleep)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    assert proc.stdout is not None
    losses: list[tuple[int, str]] = []
    saves: list[float] = []
    for line in proc.stdout:
        line = line.strip()
        if m := _STEP.match(line):
            losses.append((int(m.group(1)), m.group(2)))
            if stop_at is not None and losses[-1][0] == stop_at:
                os.killpg(proc.pid, sig)
        elif line.startswith("save "):
            saves.append(float(line.split()[1]))
    _, err = proc.communicate()
    return {"rc": proc.returncode, "losses": losses, "saves": saves, "err": err[-2000:]}


def _cmd(framework: str, how: str, root: Path) -> list[str]:
    common = ["--root", str(root), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY)]
    if how == "safepoint":
        script = "accelerate_train.py" if framework == "accelerate" else "hf_trainer_train.py"
        return [sys.executable, str(REPO / "examples" / script), *common]
    return [sys.executable, __file__, f"{framework}-native", *common]


def _newest_ckpt(framework: str, how: str, root: Path) -> Path:
    if how == "safepoint":
        dirs = list(root.glob("step-*"))
        return max(dirs, key=lambda p: int(p.name[5:]))
    if framework == "accelerate":
        return max((root / "checkpoints").glob("checkpoint_*"), key=lambda p: int(p.name.split("_")[1]))
    return max(root.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))


def _blocking_saves(how: str, root: Path, run: dict[str, Any]) -> list[float]:
    if how != "safepoint":
        return list(run["saves"])
    out = []
    for manifest in root.glob("step-*/safepoint.json"):
        timings = json.loads(manifest.read_text()).get("extra", {}).get("timings", {})
        if "stage_s" in timings:
            out.append(timings["stage_s"])
    return out


def compare(out: Path, frameworks: list[str], ways: list[str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for fw in frameworks:
        for how in ways:
            base = out / f"{fw}-{how}"
            shutil.rmtree(base, ignore_errors=True)
            base.mkdir(parents=True)
            ref = _run(_cmd(fw, how, base / "ref"))
            expected = dict(ref["losses"])
            # kill -9 at step 11 (a checkpoint every 4 steps, 12 batches an epoch: it resumes mid-epoch)
            _run(_cmd(fw, how, base / "kill"), stop_at=11, sleep=0.2)
            resumed = _run(_cmd(fw, how, base / "kill"))
            diff = sum(1 for s, loss in resumed["losses"] if expected.get(s) != loss)
            # SIGTERM to the group at step 7
            term = _run(_cmd(fw, how, base / "term"), stop_at=7, sig=signal.SIGTERM, sleep=0.2)
            after = _run(_cmd(fw, how, base / "term"))
            # the newest checkpoint cut in half, then a resume
            torn_root = base / "torn"
            shutil.copytree(base / "kill", torn_root)
            newest = _newest_ckpt(fw, how, torn_root)
            victim = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
            with open(victim, "r+b") as f:
                f.truncate(victim.stat().st_size // 2)
            torn = _run(_cmd(fw, how, torn_root))
            saves = _blocking_saves(how, base / "ref", ref)
            first = resumed["losses"][0][0] if resumed["losses"] else None
            results[f"{fw} {how}"] = {
                "resume after kill -9": f"first step {first}, {diff} of {len(resumed['losses'])} differ",
                "SIGTERM at step 7": f"exit {term['rc']}, last printed {term['losses'][-1][0]}, "
                f"restart at {after['losses'][0][0] if after['losses'] else None}",
                "save, blocking (median s)": round(statistics.median(saves), 3) if saves else None,
                "newest checkpoint torn": f"exit {torn['rc']}, first step "
                f"{torn['losses'][0][0] if torn['losses'] else None}: "
                + (torn["err"].strip().splitlines() or [""])[-1][:160],
            }
            print(json.dumps({f"{fw} {how}": results[f"{fw} {how}"]}, indent=1), flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["compare", "accelerate-native", "trainer-native"])
    p.add_argument("--root")
    p.add_argument("--out", default="/tmp/frameworks-native")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--save-every", type=int, default=SAVE_EVERY)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--frameworks", default="accelerate,trainer")
    p.add_argument("--ways", default="native,safepoint")
    args = p.parse_args()
    if args.what == "accelerate-native":
        accelerate_native(args.root, args.steps, args.save_every, args.step_sleep)
    elif args.what == "trainer-native":
        trainer_native(args.root, args.steps, args.save_every, args.step_sleep)
    else:
        compare(Path(args.out), args.frameworks.split(","), args.ways.split(","))


if __name__ == "__main__":
    main()
