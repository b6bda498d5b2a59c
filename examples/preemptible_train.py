"""A preemptible training job: what examples/slurm/train.sbatch and examples/kubernetes/job.yaml run.

    python examples/preemptible_train.py --root ckpt                          # one process
    torchrun --standalone --nproc-per-node=2 examples/preemptible_train.py --root ckpt

Stop it any way you like and start it again: it resumes from the newest intact checkpoint.
- SIGTERM or SIGUSR1 (to any rank), or creating the --preempt-file: every rank saves the current step,
  then the process exits with code 143 (safepoint.Preempted) for the orchestrator to restart it.
- kill -9: it resumes from the last periodic save, chosen by Daly's formula (save_every_seconds="auto").

Every flag can also come from the environment (SAFEPOINT_ROOT, SAFEPOINT_STEPS, ...), which is handier in
a Kubernetes manifest or a batch script.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import safepoint


def parse() -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=env("SAFEPOINT_ROOT", "ckpt"), help="checkpoint directory (shared)")
    p.add_argument("--steps", type=int, default=int(env("SAFEPOINT_STEPS", "100000")))
    p.add_argument(
        "--grace-seconds",
        type=float,
        default=float(env("SAFEPOINT_GRACE_SECONDS", "0")) or None,
        help="time from a notice to SIGKILL (Slurm: the @N of --signal; Kubernetes: the grace period)",
    )
    p.add_argument(
        "--preempt-file",
        default=env("SAFEPOINT_PREEMPT_FILE") or None,
        help="sentinel file whose existence means preempted (a Kubernetes preStop hook creates it)",
    )
    p.add_argument(
        "--mtbf-seconds",
        type=float,
        default=float(env("SAFEPOINT_MTBF_SECONDS", "0")) or None,
        help="mean time between failures; default: learned from the restarts this run has seen",
    )
    p.add_argument("--step-sleep", type=float, default=float(env("SAFEPOINT_STEP_SLEEP", "0")))
    return p.parse_args()


def main() -> None:
    args = parse()
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        # Keys the rendezvous store by torchrun attempt, so restarted workers do not read the dead attempt's
        # addresses (see docs/preemption.md, "Elastic restarts").
        safepoint.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout_s=600)
    rank = dist.get_rank() if distributed else 0
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(asctime)s %(levelname)s %(message)s")
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu")

    torch.manual_seed(0)  # the same initial weights on every rank
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
    ).to(device)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    extra = {"samples_seen": 0}
    state = safepoint.TrainState(model=model, optimizer=opt, scheduler=sched, extra=extra)

    with safepoint.CheckpointManager(
        args.root,
        save_every_seconds=safepoint.AdaptiveInterval(mtbf_s=args.mtbf_seconds),
        async_save=True,
        preemption=safepoint.PreemptionOptions(
            signals=(signal.SIGTERM, signal.SIGUSR1), grace_seconds=args.grace_seconds, file=args.preempt_file
        ),
        keep=safepoint.Keep(last=3),
    ) as mgr:
        step = mgr.restore(state)
        saved_at = step  # the step of the newest checkpoint, the same on every rank
        print(f"[rank {rank}] resumed at step {step}", flush=True)
        while step < args.steps:
            x = torch.randn(16, 32, device=device)
            loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            extra["samples_seen"] += len(x)
            step += 1
            if args.step_sleep:
                time.sleep(args.step_sleep)  # stands in for a real model's step time
            # Saves when the adaptive interval has passed; on a notice, saves this step and raises
            # safepoint.Preempted (exit code 143). The loss as a tensor: loss.item() would wait for the
            # GPU every step; metrics are read only when a save happens.
            if mgr.maybe_save(step, state, metrics={"loss": loss.detach()}):
                saved_at = step
        # Decided from what every rank did, not from a directory listing (on NFS one rank may not see the
        # newest step yet, and would enter the collective save alone).
        if saved_at != step:
            mgr.save(step, state)  # the final state, so a rerun has nothing left to do
        mgr.wait()
    print(f"[rank {rank}] finished at step {step}, samples_seen={extra['samples_seen']}", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    code = 0
    try:
        main()
    except safepoint.Preempted as e:  # saved and closed: 143 tells the orchestrator to restart the job
        code = e.code
    # End without the interpreter's teardown, in which torch 2.13's gloo threads can abort the process
    # (SIGABRT instead of `code`; docs/elastic.md, "Ending a gloo job").
    sys.stdout.flush()
    os._exit(code)
