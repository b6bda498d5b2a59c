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
import contextlib
import ctypes
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from safepoint import demo_report
from safepoint.layout import Layout

# Wide enough for the tables when the output goes to a file or a pipe (rich's default there is 80).
console = Console(highlight=False, width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 120)
_LAUNCH_TIMEOUT_S = 300.0
# Marks a directory as this demo's output: only a directory holding it is ever emptied (see _prepare_out).
MARKER = ".safepoint-demo"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Looked up here, not between fork and exec (preexec_fn), where loading a library is not safe.
_prctl: Any = getattr(ctypes.CDLL(None), "prctl", None) if sys.platform.startswith("linux") else None


def die_with_parent(sig: int, parent_ok: Callable[[int], bool]) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux; a no-op elsewhere).

    ``parent_ok(os.getppid())`` then tells whether the parent is still the expected one: if it died before
    this call, this process is an orphan already and takes ``sig`` at once. Used in torchrun (between fork
    and exec) and in every worker (demo_worker.main).
    """
    if _prctl is None:
        return
    ul = ctypes.c_ulong
    if _prctl(ctypes.c_int(_PR_SET_PDEATHSIG), ul(sig), ul(0), ul(0), ul(0)) == 0 and not parent_ok(
        os.getppid()
    ):
        os.kill(os.getpid(), sig)


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (Linux /proc), None if unknown."""
    try:
        # "pid (comm) state ppid ...": comm may hold spaces, so split after its closing parenthesis.
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


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


class Launch:
    """One torchrun launch of safepoint.demo_worker; its events are the workers' JSON lines."""

    def __init__(
        self, out: Path, name: str, world: int, jobs: list[dict[str, Any]], max_restarts: int = 0
    ) -> None:
        self.name, self.world = name, world
        self.prefix = out / "logs" / name
        plan = out / "logs" / f"{name}.plan.json"
        jobs = [{**j, "done": f"{self.prefix}.{j['name']}"} for j in jobs]
        plan.write_text(json.dumps({"log": str(self.prefix), "jobs": jobs}, indent=1))
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world}",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.1",
            "-m",
            "safepoint.demo_worker",
            str(plan),
        ]
        # Every worker checks that its torchrun is still this demo's child (demo_worker.main).
        env = dict(os.environ, OMP_NUM_THREADS="1", SAFEPOINT_DEMO_PID=str(os.getpid()))
        self.log_path = out / "logs" / f"{name}.torchrun.log"
        self.t_start = time.time()
        demo = os.getpid()
        with open(self.log_path, "w") as log:  # a file, not a pipe: nothing blocks on a full pipe
            # Its own session: Ctrl-C in the terminal reaches the demo only, which then stops the launch.
            # If the demo dies without stopping it (SIGKILL, a crash), the kernel SIGKILLs torchrun, and
            # each worker's own death signal then takes it (SIGKILL: torchrun would give SIGTERMed workers
            # 30 s, and a rank waiting for the injector's SIGKILL does not act on a SIGTERM).
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=lambda: die_with_parent(signal.SIGKILL, lambda ppid: ppid == demo),
            )
        self._offsets: dict[Path, int] = {}
        self.events: list[dict[str, Any]] = []
        self.rc: int | None = None
        self.t_end = 0.0

    def poll_events(self) -> list[dict[str, Any]]:
        """Events written since the last call (complete lines only)."""
        new: list[dict[str, Any]] = []
        for rank in range(self.world):
            path = Path(f"{self.prefix}.rank{rank}.jsonl")
            if not path.exists():
                continue
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offsets[path] = self._offsets.get(path, 0) + end
            new += [{**json.loads(line), "launch": self.name} for line in data[:end].splitlines() if line]
        self.events += new
        return new

    def wait(self, on_event: Callable[[dict[str, Any] | None], None] | None = None) -> int:
        """Wait for the launch to end; ``on_event`` sees every event, and None about every 20 ms."""
        deadline = time.monotonic() + _LAUNCH_TIMEOUT_S
        try:
            while self.proc.poll() is None:
                for ev in [*self.poll_events(), None]:
                    if on_event:
                        on_event(ev)
                if time.monotonic() > deadline:
                    raise SystemExit(f"demo: launch {self.name} did not finish in {_LAUNCH_TIMEOUT_S:.0f}s")
                time.sleep(0.02)
        finally:
            if self.proc.poll() is None:  # a timeout or Ctrl-C
                self._stop()
        for ev in self.poll_events():
            if on_event:
                on_event(ev)
        self.events.sort(key=lambda e: e["t"])
        self.rc, self.t_end = self.proc.returncode, time.time()
        return self.rc

    def _stop(self) -> None:
        """SIGKILL torchrun and every live process under it.

        torchrun starts each worker in a session of its own, so killing torchrun's group would leave them
        running. They are found by walking /proc down from torchrun while it is stopped: a pid in that
        tree is a live process (or a zombie no one can reap meanwhile), never a reused pid of a worker
        that died long ago. Elsewhere than Linux the workers' own death signal is all there is.
        """
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGSTOP)  # no new workers, no reaping, until it is killed
        for pid in reversed(_descendants(self.proc.pid)):  # the deepest first
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def result(self, label: str, role: str, job: str) -> demo_report.LaunchResult:
        """One job's part of this launch (a launch can run two jobs one after the other)."""
        assert self.rc is not None
        events = [e for e in self.events if e["job"] == job]
        before = [e["t"] for e in self.events if e["job"] != job and e["event"] == "finished"]
        t_start = max([t for t in before if t < events[0]["t"]], default=self.t_start) if events else 0.0
        t_end = max((e["t"] for e in events if e["event"] == "finished"), default=self.t_end)
        return demo_report.LaunchResult(label, role, self.world, self.rc, t_start, t_end, events)


def _descendants(root: int) -> list[int]:
    """The live processes under ``root`` now (Linux /proc; empty elsewhere), parents before children."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # "pid (comm) state ppid ...": comm may hold spaces, so split after its closing parenthesis.
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z":  # a zombie is dead already
                children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(0), [])
        found += kids
        todo += kids
    return found


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
        if sys.platform.startswith("linux") and k["pid"] not in _descendants(self.launch.proc.pid):
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


class _Signalled(BaseException):
    """A SIGTERM or SIGHUP to the demo: unwinds through Launch.wait, which stops the launch in progress."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _exit_on(signum: int, frame: Any) -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a second one must not cut the cleanup short
        signal.signal(sig, signal.SIG_IGN)
    raise _Signalled(signum)


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
        signal.signal(sig, _exit_on)
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
    except _Signalled as e:  # the same
        console.print(f"stopped by {signal.Signals(e.signum).name}")
        return 128 + e.signum


if __name__ == "__main__":
    sys.exit(main())
