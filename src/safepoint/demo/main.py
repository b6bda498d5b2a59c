"""safepoint demo: a real 2-rank torchrun job survives four faults and ends where it would have anyway.

A small transformer trains on generated data under torchrun (gloo, CPU) with safepoint: async saves, a
ResumableSampler, per-rank RNG, SIGTERM handling. The demo plays the cluster and breaks it four times,
each a real process event:

  1. SIGKILL of rank 1 mid-training: torchrun (--max-restarts=1) restarts both ranks, they resume
  2. SIGTERM to torchrun (a preemption): emergency save, exit 143; the relaunch resumes at that step
  3. the newest checkpoint corrupted (bytes flipped in a data file): restore warns and falls back
  4. the relaunch runs on 1 rank instead of 2: DCP reshards the 2-rank checkpoint

Then it compares the weights and optimizer state with uninterrupted reference runs: bitwise at the end of
the 2-rank part, and bitwise at the end after the 2 -> 1 change (against a reference that changes world
size at the same step without faults). It prints a summary table, writes DIR/summary.json and a PNG
timeline, and exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from safepoint.demo import report as demo_report
from safepoint.demo.procs import Launch, Signalled, descendants, exit_on
from safepoint.store.posix_layout import Layout

# Wide enough for the tables when the output goes to a file or a pipe (rich's default there is 80).
console = Console(highlight=False, width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 120)
# Marks a directory as this demo's output: only a directory holding it is ever emptied (see _prepare_out).
MARKER = ".safepoint-demo"


@dataclasses.dataclass(frozen=True)
class Schedule:
    steps: int  # the run's last step
    save_every: int
    kill_after: int  # rank 1 is SIGKILLed soon after this step (torchrun attempt 0)
    preempt_after: int  # torchrun gets SIGTERM soon after this step (attempt 1)
    resize_at: int  # the 2-rank part ends here; its checkpoint is the one corrupted; then 1 rank


# The SIGTERM comes just after a periodic save and far from the next one (the ranks compare notices about
# every 0.25 s of training, 10-20 fast steps here), so that a periodic save falls between the emergency
# save and resize_at: the faulty run falls back to it, and the reference has it too. The SIGKILL comes
# mid-interval, so steps are lost.
FULL = Schedule(steps=250, save_every=25, kill_after=60, preempt_after=76, resize_at=175)
QUICK = Schedule(steps=80, save_every=16, kill_after=20, preempt_after=33, resize_at=64)


def _say(msg: str) -> None:
    console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {msg}")


def _expect(launch: Launch, ok: bool, what: str) -> None:
    if not ok:
        tail = launch.log_path.read_text()[-3000:]
        console.print(f"[red]launch {launch.name}: {what} (exit {launch.rc}); torchrun log tail:[/]\n{tail}")
        raise SystemExit(1)


def _manifests(root: Path, into: dict[str, dict[str, Any]]) -> None:
    """Collect every committed manifest (by save id): checkpoints replaced later still count as saves."""
    layout = Layout(root)
    for step in layout.committed_steps():
        m = layout.read_manifest(step)
        t = m.extra.get("timings", {})
        into[m.save_id] = {
            "step": m.step,
            "bytes": m.total_bytes,
            "write_s": t.get("write_s"),
            "world_size": m.world_size,
            "emergency": "emergency" in m.extra,
        }


def _corrupt_newest(root: Path) -> dict[str, Any]:
    """Flip 64 bytes in the middle of the newest checkpoint's largest data file, as a bad disk would."""
    layout = Layout(root)
    step = layout.committed_steps()[-1]
    target = max(layout.step_path(step).glob("*.distcp"), key=lambda p: p.stat().st_size)
    size = target.stat().st_size
    with open(target, "r+b") as f:
        f.seek(size // 2)
        chunk = f.read(64)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    return {"step": step, "file": target.name, "offset": size // 2, "bytes": 64}


class Injector:
    """Plays the cluster during launch A: SIGKILLs the announcing rank, SIGTERMs torchrun."""

    def __init__(self, run_root: Path, faults: list[dict[str, Any]]) -> None:
        self.run_root, self.faults = run_root, faults
        self.launch: Launch | None = None
        self.pending_kill: dict[str, Any] | None = None

    def _kill_rank(self, k: dict[str, Any]) -> None:
        """SIGKILL the rank that announced itself, only if it is still one of torchrun's processes."""
        assert self.launch is not None
        gone = SystemExit(
            f"demo: fault 1 did not happen: rank {k['rank']} (pid {k['pid']}) exited before its SIGKILL; "
            f"see {self.launch.log_path}"
        )
        # The announcing rank waits for the signal; a pid no longer under torchrun is not that rank.
        if sys.platform.startswith("linux") and k["pid"] not in descendants(self.launch.proc.pid):
            raise gone
        try:
            os.kill(k["pid"], signal.SIGKILL)
        except ProcessLookupError:
            raise gone from None

    def __call__(self, ev: dict[str, Any] | None) -> None:
        assert self.launch is not None
        if ev is None:
            # A kill before the first checkpoint committed would only show a restart from step 0: hold
            # the SIGKILL until one has (the announcing rank waits for it meanwhile).
            if self.pending_kill and Layout(self.run_root).committed_steps():
                k, self.pending_kill = self.pending_kill, None
                self._kill_rank(k)
                self.faults.append({"kind": "sigkill", "t": time.time(), "rank": k["rank"], "pid": k["pid"]})
                who = f"rank {k['rank']} (pid {k['pid']})"
                _say(f"  [red]fault 1[/]: SIGKILL to {who} after step {k['step']}")
        elif ev["event"] == "kill-ready":
            self.pending_kill = ev
        elif ev["event"] == "preempt-ready":
            pid = self.launch.proc.pid
            os.kill(pid, signal.SIGTERM)  # to torchrun, as Kubernetes or Slurm would; it forwards it
            self.faults.append({"kind": "sigterm", "t": time.time(), "pid": pid})
            _say(f"  [yellow]fault 2[/]: SIGTERM to torchrun (pid {pid}) after step {ev['step']}")
        elif ev["event"] == "restored" and ev["rank"] == 0 and ev["job"] == "run":
            _say(f"  faulty run, attempt {ev['attempt']}: restored step {ev['step']}")
        elif ev["event"] == "finished" and ev["rank"] == 0 and ev["job"] == "reference":
            _say(f"  reference done (step {ev['step']}); the faulty run starts")
        elif ev["event"] == "preempted" and ev["rank"] == 0:
            _say(f"  emergency save of step {ev['saved_step']}; workers exit {ev['code']} (Preempted)")


def run(out: Path, sch: Schedule) -> int:
    t0 = time.time()
    (out / "logs").mkdir()
    faults: list[dict[str, Any]] = []
    saves: dict[str, dict[str, Any]] = {}
    names = ("ref_resize", "ref_end", "run_resize", "run_end", "ref1_end")
    snap = {name: str(out / f"{name}.pt") for name in names}
    ref_root, run_root = out / "reference" / "ckpt", out / "run" / "ckpt"

    def job(name: str, root: Path, steps: int, **kw: Any) -> dict[str, Any]:
        common = {"save_every": sch.save_every, "total_steps": sch.steps}
        return {"name": name, "root": str(root), "steps": steps, **common, **kw}

    # The uninterrupted reference runs first in the same torchrun launch (one start of 2 workers less);
    # after torchrun's restart it is done and skipped.
    _say(
        f"[bold]launch A[/]: torchrun, 2 ranks, --max-restarts=1: the reference (steps 0 -> {sch.steps}, "
        f"no faults), then the faulty run (checkpoints every {sch.save_every} steps)"
    )
    ref_snaps = {sch.resize_at: snap["ref_resize"], sch.steps: snap["ref_end"]}
    kill = {"attempt": 0, "rank": 1, "after": sch.kill_after}
    preempt = {"attempt": 1, "rank": 0, "after": sch.preempt_after}
    jobs = [
        job("reference", ref_root, sch.steps, snapshots=ref_snaps),
        job("run", run_root, sch.resize_at, kill=kill, preempt=preempt),
    ]
    injector = Injector(run_root, faults)
    a = injector.launch = Launch(out, "A", 2, jobs, max_restarts=1)
    _expect(a, a.wait(injector) != 0, "expected a preempted (non-zero) exit")
    _manifests(run_root, saves)

    _say(f"[bold]launch B[/]: relaunch, 2 ranks, until step {sch.resize_at}")
    b = Launch(
        out, "B", 2, [job("run", run_root, sch.resize_at, snapshots={sch.resize_at: snap["run_resize"]})]
    )
    _expect(b, b.wait() == 0, "the relaunch after the preemption failed")
    _say(f"  restored step {_restored(b)}, trained to step {sch.resize_at}")
    _manifests(run_root, saves)

    hit = _corrupt_newest(run_root)
    faults.append({"kind": "corrupt", "t": time.time(), **hit})
    where = f"step-{hit['step']}/{hit['file']}"
    _say(f"  [magenta]fault 3[/]: flipped {hit['bytes']} bytes in {where} (the newest checkpoint)")

    # The reference for the part after the world-size change: the uninterrupted run's copy of the
    # checkpoint the faulty run should fall back to, continued on 1 rank the same way, without faults.
    # It runs in launch C too, after the faulty run.
    older = max((s["step"] for s in saves.values() if s["step"] < hit["step"]), default=0)
    ref1_root = out / "reference-1rank" / "ckpt"
    _seed_reference(ref_root, ref1_root, older)

    faults.append({"kind": "resize", "t": time.time(), "from": 2, "to": 1})
    _say(f"[bold]launch C[/]: [cyan]fault 4[/]: relaunch on 1 rank instead of 2, until step {sch.steps}")
    jobs = [
        job("run", run_root, sch.steps, snapshots={sch.steps: snap["run_end"]}),
        job("reference-1rank", ref1_root, sch.steps, snapshots={sch.steps: snap["ref1_end"]}),
    ]
    c = Launch(out, "C", 1, jobs)

    def on_c(ev: dict[str, Any] | None) -> None:
        if ev and ev["event"] == "restored" and ev["job"] == "run":
            _say(f"  restored step {ev['step']} (saved by {ev['saved_world_size']} ranks) on 1 rank")
        elif ev and ev["event"] == "restored":
            _say(f"  then the reference: 1 rank, from the reference's step {ev['step']}, no faults")

    _expect(c, c.wait(on_c) == 0, "the 1-rank relaunch failed")
    _manifests(run_root, saves)

    report = demo_report.Report(
        schedule=dataclasses.asdict(sch),
        launches=[
            a.result("reference", "reference", "reference"),
            a.result("A", "run", "run"),
            b.result("B", "run", "run"),
            c.result("C", "run", "run"),
            c.result("reference-1rank", "reference", "reference-1rank"),
        ],
        faults=faults,
        saves=list(saves.values()),
        snapshots={k: Path(v) for k, v in snap.items()},
        wall_s=time.time() - t0,
        run_root=run_root,
    )
    return demo_report.finish(report, out, console)


def _seed_reference(ref_root: Path, ref1_root: Path, step: int) -> None:
    """Copy the reference's checkpoint of ``step`` (the one the faulty run falls back to) to start the
    1-rank reference from; without it that reference would train from scratch and the check mean nothing.
    """
    src = ref_root / f"step-{step}"
    if not src.is_dir():
        kept = ", ".join(p.name for p in sorted(ref_root.glob("step-*"))) or "none"
        raise SystemExit(
            f"demo: the reference has no checkpoint of step {step} to start the 1-rank reference from "
            f"(it has: {kept}); its saves and the faulty run's no longer line up"
        )
    ref1_root.mkdir(parents=True)
    shutil.copytree(src, ref1_root / src.name)


def _prepare_out(out: Path) -> str | None:
    """Make ``out`` an empty directory holding only MARKER; an error message if it must not be touched.

    A directory that is not empty is emptied only if it holds MARKER (an earlier demo's output): --out
    pointed at a directory of one's own must not vanish.
    """
    if out.exists() and not out.is_dir():
        return f"{out} exists and is not a directory; choose another --out"
    if out.is_dir() and any(out.iterdir()):
        if not (out / MARKER).is_file():
            return (
                f"{out} is not empty and not the output of an earlier demo (it has no {MARKER} file); "
                "choose another --out"
            )
        for child in out.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("output of `safepoint demo`: the next demo run with this --out replaces it\n")
    return None


def _restored(launch: Launch) -> int:
    return next((e["step"] for e in launch.events if e["event"] == "restored" and e["rank"] == 0), -1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="safepoint demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  safepoint demo                       # the full run, into demo-out/\n"
        "  safepoint demo --quick --out /tmp/d  # fewer steps, the same four faults",
    )
    p.add_argument(
        "--out",
        default="demo-out",
        metavar="DIR",
        help=f"output directory: created, or replaced if it is empty or an earlier demo's (it holds {MARKER})"
        " (default: demo-out)",
    )
    p.add_argument("--quick", action="store_true", help=f"{QUICK.steps} steps instead of {FULL.steps}")
    a = p.parse_args(argv)
    out = Path(a.out)
    try:
        error = _prepare_out(out)
    except OSError as e:
        error = f"cannot prepare {out}: {e}"
    if error:
        p.error(error)
    # A SIGTERM or SIGHUP (a closed terminal, a job scheduler) exits through the finally clauses, which
    # stop the launch in progress; a SIGKILL is left to the death signals (Launch).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, exit_on)
    sch = QUICK if a.quick else FULL
    console.print(
        f"[bold]safepoint demo[/]: {sch.steps} steps of a small transformer under torchrun, four faults; "
        f"output in {out}/"
    )
    try:
        return run(out, sch)
    except KeyboardInterrupt:  # the launch in progress was stopped on the way out (Launch.wait)
        console.print("interrupted")
        return 130
    except Signalled as e:  # the same
        console.print(f"stopped by {signal.Signals(e.signum).name}")
        return 128 + e.signum


if __name__ == "__main__":
    sys.exit(main())
