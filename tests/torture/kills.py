"""Random SIGKILL campaigns against real training processes, with exactness checks.

Single process: training children forked by the zygote (scenarios.train), killed at random moments
(aimed from their own begin/end-of-save lines); after every kill this process restores and compares the
state bitwise with an uninterrupted run at that step; at the end a child resumes and trains to the last
step, and every step it trained matches the uninterrupted run.

Two ranks: one torchrun launch (dist_train.py) with ``--max-restarts``; a random rank is SIGKILLed at a
random moment, torchrun restarts both, they resume. Everything is checked from the ranks' logs after the
launch, and the final model and optimizer are compared bitwise with an uninterrupted run.

Both gate the run: it waits before its last step until this process has made every kill (it writes a
finish file then: ROOT.finish, OUT/finish), and a kill not made when the run gets there (the last one
always) is made at that gate: the kill count is exact however late this process reads the run's lines.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import safepoint
from safepoint.store.posix_layout import Layout
from tests.helpers.train import Setup, assert_bitwise_equal
from tests.torture.dist_train import FINISH
from tests.torture.harness import ENV, REPO, Zygote


@dataclasses.dataclass
class KillResult:
    kills: int = 0
    gate_kills: int = 0  # kills made at the gate (the last one always; others when this process lagged)
    restores: int = 0  # restores checked bitwise against the uninterrupted run
    lost: int = 0  # committed checkpoints lost (must stay 0)
    corrupt: int = 0  # restores that loaded a state differing from that step's (must stay 0)
    restored_steps: list[int] = dataclasses.field(default_factory=list)
    violations: list[str] = dataclasses.field(default_factory=list)


CHILD_TIMEOUT = 120.0  # how long one training child may run before it counts as hung (Zygote.messages)


def sleep_into_save(rng: random.Random, durations: list[float]) -> None:
    """Called as a save ends: sleep to a random moment of the next one (up to 1.2 typical saves, the median
    of ``durations``; 50 ms if none was timed), where the kill lands."""
    typical = sorted(durations)[len(durations) // 2] if durations else 0.05
    time.sleep(rng.uniform(0, typical * 1.2))


def reference(zygote: Zygote, root: Path, total: int, out: Path) -> dict[int, dict[str, torch.Tensor]]:
    """An uninterrupted run: the state after every step (no gate: it is never killed)."""
    code = zygote.run(
        {"scenario": "train", "args": {"root": str(root), "total": total, "snapshots": str(out)}}, timeout=300
    )
    assert code == 0, zygote.log_tail()
    ref: dict[int, dict[str, torch.Tensor]] = torch.load(out, weights_only=True)
    return ref


def single_process_campaign(
    zygote: Zygote,
    root: Path,
    ref: dict[int, dict[str, torch.Tensor]],
    kills: int,
    seed: int,
    snapshots: Path,
) -> KillResult:
    rng = random.Random(seed)
    total = max(ref)
    result = KillResult()
    finish = root.parent / f"{root.name}.{FINISH}"  # the children's gate: open once every kill is made
    finish.unlink(missing_ok=True)
    committed = 0  # the newest step whose save returned before the last kill
    try:
        while result.kills < kills:
            cmd = _train(root, total, finish)
            committed = _kill_child(zygote, cmd, rng, result, committed, last=result.kills == kills - 1)
            committed = max(committed, _check_restore(root, ref, committed, result))
    finally:
        finish.touch()  # never leave a child waiting at the gate
    # The exactness check: resume once more (at the open gate) and train to the end; every step matches the
    # uninterrupted run.
    code = zygote.run(_train(root, total, finish, snapshots=str(snapshots)), timeout=300)
    if code != 0:
        result.violations.append(f"the final run exited {code}")
        return result
    trained: dict[int, dict[str, torch.Tensor]] = torch.load(snapshots, weights_only=True)
    if total not in trained and result.restored_steps and result.restored_steps[-1] != total:
        result.violations.append("the final run did not reach the last step")
    for step, snap in trained.items():
        try:
            assert_bitwise_equal(ref[step], snap)
        except AssertionError as e:
            result.violations.append(f"after the kills, step {step} differs from the uninterrupted run: {e}")
            break
    return result


def _train(root: Path, total: int, finish: Path, **args: Any) -> dict[str, Any]:
    """The zygote command of a gated training child. The deadline is a backstop for a parent that died
    without opening the gate; this process's own timeout on the child comes first."""
    gate = {"path": str(finish), "deadline": time.time() + CHILD_TIMEOUT + 60}
    return {"scenario": "train", "args": {"root": str(root), "total": total, "gate": gate, **args}}


def _kill_child(
    zygote: Zygote, cmd: dict[str, Any], rng: random.Random, result: KillResult, committed: int, last: bool
) -> int:
    """Start a training child and SIGKILL it: a random moment of the save after 1-3 of its saves, or at
    once when it reports its gate (no save in flight; a kill this process has not made by then). The last
    kill waits for the gate: the child always gets there, so every campaign checks that the gate holds it
    and that a resume there is exact. Returns the newest step committed before the kill."""
    pid = zygote.start(cmd)
    target, ends, durations, began = rng.randint(1, 3), 0, [], time.monotonic()
    at_gate = False
    for msg in zygote.messages(timeout=CHILD_TIMEOUT):
        ev = msg.get("ev")
        if ev == "restored" and msg["step"] < committed:
            result.violations.append(f"a child restored step {msg['step']} after {committed} was committed")
        elif ev == "begin":
            began = time.monotonic()
        elif ev == "end":
            durations.append(time.monotonic() - began)
            committed = msg["step"]
            ends += 1
            if ends >= target and not last:
                break
        elif ev == "gate":
            at_gate = True
            break
        elif "status" in msg:  # it cannot end before the gate opens: it failed
            raise AssertionError(f"a child exited before kill {result.kills + 1}:\n{zygote.log_tail()}")
    if not at_gate:
        sleep_into_save(rng, durations)
    os.kill(pid, signal.SIGKILL)
    for msg in zygote.messages(timeout=60):
        if msg.get("ev") == "end":
            committed = msg["step"]  # finished before the signal landed
    result.kills += 1
    result.gate_kills += at_gate
    return committed


def _check_restore(
    root: Path, ref: dict[int, dict[str, torch.Tensor]], committed: int, result: KillResult
) -> int:
    """Restore here after a kill: never older than ``committed``, the newest listed, bitwise the
    uninterrupted run's state at that step, nothing left pending. Returns the step restored."""
    s = Setup(seed=9)
    with safepoint.CheckpointManager(root) as mgr:
        listed = [c.step for c in mgr.list()]
        step = mgr.restore(s.state(rng=False))
    leftovers = sorted(p.name for p in (root / ".pending").iterdir())
    result.restores += 1
    result.restored_steps.append(step)
    if step < committed:
        result.lost += 1
        result.violations.append(f"kill {result.kills}: restored step {step}, but {committed} was committed")
    if listed and step != listed[-1]:
        result.violations.append(f"kill {result.kills}: restored {step}, not the newest listed {listed[-1]}")
    if leftovers:
        result.violations.append(f"kill {result.kills}: .pending not cleaned: {leftovers}")
    if step:
        try:
            assert_bitwise_equal(ref[step], s.snapshot())
        except AssertionError as e:
            result.corrupt += 1
            result.violations.append(f"kill {result.kills}: step {step} restored a different state: {e}")
    return step


# ---- two ranks under torchrun -----------------------------------------------------------------------------

WORKER = REPO / "tests" / "torture" / "dist_train.py"


@dataclasses.dataclass
class DistResult:
    kills: int = 0
    gate_kills: int = 0  # kills made at the run's gate (the last one always; others when the harness lagged)
    attempts: int = 0
    unplanned_restarts: int = 0  # attempts that failed without a kill of ours (e.g. a gloo connect error)
    lost: int = 0
    violations: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


class _Tail:
    """New JSON lines of the ranks' logs since the last call, in the order they were written."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.offsets: dict[Path, int] = {}
        self.partial: dict[Path, bytes] = {}

    def poll(self) -> list[dict[str, Any]]:
        events = []
        for path in sorted(self.out.glob("log.rank*.jsonl")):
            rank = int(path.stem.split("rank")[1])
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = self.partial.get(path, b"") + f.read()
                self.offsets[path] = f.tell()
            *lines, self.partial[path] = data.split(b"\n")
            events += [{**json.loads(line), "rank": rank} for line in lines if line]
        # Interleaved by time, not file after file: one rank's later lines must not come before the
        # other's earlier ones (its "restored", which aims a kill).
        return sorted(events, key=lambda e: e["t"])


def events(out: Path) -> list[dict[str, Any]]:
    return _Tail(out).poll()


class _Aim:
    """The next kill of the "run" job, aimed from its ranks' events: at the newest attempt both of whose
    ranks restored, after 1-3 of its saves (a random moment of the next one), or at once at the gate."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.pids: dict[int, dict[int, int]] = {}  # attempt -> rank -> pid
        self.gated: set[int] = set()  # attempts whose ranks reached the gate (dist_train.py)
        self.attempt = -1  # the attempt aimed at
        self.done = -1  # the newest attempt killed (or found gone): the next aim must be newer
        self.target = self.ends = 0
        self.durations: list[float] = []
        self.began = 0.0

    def see(self, ev: dict[str, Any]) -> None:
        a = ev["attempt"]
        if ev["job"] != "run" or a <= self.done:
            return
        if ev["event"] == "restored":
            self.pids.setdefault(a, {})[ev["rank"]] = ev["pid"]
            # Both ranks resumed: aim at it (also over an aimed attempt that failed by itself meanwhile).
            if len(self.pids[a]) == 2 and a > self.attempt:
                self.attempt, self.target, self.ends, self.durations = a, self.rng.randint(1, 3), 0, []
        elif ev["event"] == "gate":
            self.gated.add(a)  # before the attempt is aimed, too: the other rank's "restored" may come later
        elif a == self.attempt and ev["rank"] == 0 and ev["event"] == "begin":
            self.began = ev["t"]
        elif a == self.attempt and ev["rank"] == 0 and ev["event"] == "end":
            self.durations.append(ev["t"] - self.began)
            self.ends += 1

    def at_gate(self) -> bool:
        return self.attempt > self.done and self.attempt in self.gated

    def ready(self, last: bool) -> bool:
        """Whether to kill now. The last kill waits for the gate: the run always gets there, so every
        campaign checks that the gate holds it and that a resume there is exact."""
        aimed = self.attempt > self.done
        return self.at_gate() or (aimed and not last and self.ends >= self.target)

    def fire(self) -> bool:
        """SIGKILL a random rank of the aimed attempt: at the gate at once (no save is in flight, any moment
        is as good), otherwise a random fraction of a save later. False if it was gone already."""
        if not self.at_gate():
            sleep_into_save(self.rng, self.durations)
        victim = self.pids[self.attempt][self.rng.randrange(2)]
        self.done = self.attempt
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            return False  # the run cannot end before the gate opens: that attempt failed by itself
        return True


def dist_campaign(out: Path, kills: int, seed: int, steps: int, timeout: float) -> DistResult:
    out.mkdir(parents=True, exist_ok=True)
    plan = out / "plan.json"
    # The gate's deadline is a backstop for a harness that died without opening it (its own timeout,
    # below, comes first).
    gate = {"job": "run", "deadline": time.time() + timeout + 60}
    plan.write_text(json.dumps({"out": str(out), "steps": steps, "jobs": ["ref", "run"], "gate": gate}))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        f"--max-restarts={kills + 5}",
        "--monitor-interval=0.1",
        str(WORKER),
        str(plan),
    ]
    result = DistResult()
    t0 = time.monotonic()
    with open(out / "torchrun.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=ENV, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            _make_kills(proc, out, kills, random.Random(seed), result, t0 + timeout)
            while proc.poll() is None and time.monotonic() < t0 + timeout:
                time.sleep(0.05)
            if proc.poll() is None:
                raise AssertionError(f"the 2-rank campaign ran past {timeout}s")
        finally:
            (out / FINISH).touch()  # never leave the ranks waiting at the gate
            _stop(proc)
    result.seconds = time.monotonic() - t0
    if proc.returncode != 0:
        result.violations.append(
            f"torchrun exited {proc.returncode}: {(out / 'torchrun.log').read_text()[-3000:]}"
        )
        return result
    _check_dist_logs(out, result)
    return result


def _make_kills(
    proc: subprocess.Popen[bytes],
    out: Path,
    kills: int,
    rng: random.Random,
    result: DistResult,
    deadline: float,
) -> None:
    """Every kill, then open the gate: the run cannot take its last step before (dist_train.py)."""
    tail, aim = _Tail(out), _Aim(rng)
    while result.kills < kills and proc.poll() is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"the 2-rank campaign ran past its timeout after {result.kills} kills")
        for ev in tail.poll():
            aim.see(ev)
        if aim.ready(last=result.kills == kills - 1):
            at_gate = aim.at_gate()
            if aim.fire():
                result.kills += 1
                result.gate_kills += at_gate
        time.sleep(0.005)
    (out / FINISH).touch()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End torchrun if it still runs. SIGTERM, so that it stops the ranks: they run in sessions of their
    own, and a SIGKILL of torchrun alone would leave them behind."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=60)


def _check_dist_logs(out: Path, result: DistResult) -> None:
    evs = events(out)
    run = [e for e in evs if e["job"] == "run"]
    attempts = sorted({e["attempt"] for e in run})
    result.attempts = len(attempts)
    result.unplanned_restarts = max(0, len(attempts) - 1 - result.kills)
    previous_end = 0
    previous_begin = 0
    for a in attempts:
        starts = {e["rank"]: e for e in run if e["attempt"] == a and e["event"] == "restored"}
        if sorted(starts) != [0, 1]:
            if a != attempts[-1] or starts:
                result.violations.append(f"attempt {a}: restored on ranks {sorted(starts)} only")
            continue
        step = starts[0]["step"]
        if starts[1]["step"] != step:
            result.violations.append(
                f"attempt {a}: ranks restored different steps {starts[0]['step']}, {starts[1]['step']}"
            )
        listed = starts[0]["listed"]
        if listed and step != max(listed):
            result.violations.append(
                f"attempt {a}: restored {step}, not the newest listed {max(listed)} (corrupt?)"
            )
        if step < previous_end:
            result.lost += 1
            result.violations.append(
                f"attempt {a}: restored {step}, but {previous_end} was committed before the kill"
            )
        if step > max(previous_begin, previous_end):
            result.violations.append(
                f"attempt {a}: restored {step}, never saved before (last began {previous_begin})"
            )
        mine = [e for e in run if e["attempt"] == a and e["rank"] == 0]
        previous_end = max([e["step"] for e in mine if e["event"] == "end"], default=step)
        previous_begin = max([e["step"] for e in mine if e["event"] == "begin"], default=step)
    ref_final = torch.load(out / "ref.final.pt", weights_only=True)
    run_final = torch.load(out / "run.final.pt", weights_only=True)
    try:
        _assert_bitwise(ref_final, run_final, "final")
    except AssertionError as e:
        result.violations.append(f"final state after the kills differs from the uninterrupted run: {e}")
    for rank in (0, 1):
        fin = {e["job"]: e for e in evs if e["event"] == "finished" and e["rank"] == rank}
        if fin["ref"]["draw"] != fin["run"]["draw"] or fin["ref"]["seen"] != fin["run"]["seen"]:
            result.violations.append(f"rank {rank}: RNG or data position differs from the uninterrupted run")
    layout = Layout(out / "run" / "ckpt")
    for s in layout.committed_steps():
        layout.verify(s)
    leftovers = list((out / "run" / "ckpt" / ".pending").iterdir())
    if leftovers:
        result.violations.append(f".pending not empty at the end: {leftovers}")


def _assert_bitwise(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys differ"
        for k in a:
            _assert_bitwise(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
