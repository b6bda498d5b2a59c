"""What ``safepoint demo`` reports: the faults as they happened, save statistics and the verdict.

Everything here is computed from what the processes recorded (the workers' JSON lines, the committed
manifests, the weights they wrote); nothing is taken from the schedule the demo intended.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import signal
import statistics
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from safepoint.demo import plot as demo_plot
from safepoint.demo.launch import LaunchResult
from safepoint.policy.goodput import RunReport, build_report, report_lines


@dataclasses.dataclass
class Report:
    schedule: dict[str, int]
    launches: list[LaunchResult]
    faults: list[dict[str, Any]]
    saves: list[dict[str, Any]]  # every committed manifest of the faulty run
    snapshots: dict[str, Path]
    wall_s: float
    run_root: Path | None = None  # the faulty run's root: `safepoint report` of it ends the demo


@dataclasses.dataclass
class Segment:
    """One generation of worker processes of the faulty run: from its restore to where it stopped."""

    launch: str
    attempt: int
    world: int
    restored: int
    reached: int
    fallback: str | None


@dataclasses.dataclass
class Check:
    name: str
    ok: bool
    detail: str


def segments(runs: list[LaunchResult]) -> list[Segment]:
    out = []
    for launch in runs:
        for attempt in sorted({e["attempt"] for e in launch.events}):
            evs = [e for e in launch.events if e["attempt"] == attempt]
            restored = [e["step"] for e in evs if e["event"] == "restored" and e["rank"] == 0]
            steps = [e["step"] for e in evs if e["event"] == "step"]
            fallback = [e["message"] for e in evs if e["event"] == "fallback"]
            if restored:
                reached = max(steps, default=restored[0])
                out.append(
                    Segment(launch.name, attempt, launch.world, restored[0], reached, (fallback or [None])[0])
                )
    return out


def compare(a: Path, b: Path) -> tuple[bool, float, int]:
    """(bitwise identical, max abs difference, tensors compared) of two saved full states."""
    import torch

    if not (a.exists() and b.exists()):
        return False, math.nan, 0
    flat_a, flat_b = _flatten(torch.load(a, weights_only=True)), _flatten(torch.load(b, weights_only=True))
    identical, worst, n = flat_a.keys() == flat_b.keys(), 0.0, 0
    for key in flat_a.keys() & flat_b.keys():
        x, y = flat_a[key], flat_b[key]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            n += 1
            if x.shape != y.shape or x.dtype != y.dtype:
                identical, worst = False, math.inf
                continue
            if not torch.equal(x, y):
                identical = False
            if x.is_floating_point() and x.numel():
                worst = max(worst, (x.double() - y.double()).abs().max().item())
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) or x != y:
            identical = False
    return identical, worst, n


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(obj, (list, tuple)):
        return _flatten(dict(enumerate(obj)), prefix)
    return {prefix.rstrip("."): obj}


def checks(r: Report, segs: list[Segment]) -> tuple[list[Check], dict[str, Any]]:
    sch, runs = r.schedule, [launch for launch in r.launches if launch.role == "run"]
    by_name = {launch.name: launch for launch in r.launches}
    a, b, c = by_name["A"], by_name["B"], by_name["C"]
    kinds = {f["kind"] for f in r.faults}
    out: list[Check] = []

    a1 = [s for s in segs if s.launch == "A" and s.attempt == 1]
    killed_after = max((s.reached for s in segs if s.launch == "A" and s.attempt == 0), default=-1)
    out.append(
        Check(
            "SIGKILL: torchrun restart resumes",
            "sigkill" in kinds and bool(a1) and 0 < a1[0].restored <= killed_after,
            f"rank 1 killed after step {killed_after}; attempt 1 resumed at step "
            f"{a1[0].restored if a1 else '-'}",
        )
    )
    pre = [e for e in a.of("preempted") if e["attempt"] == 1]
    saved = pre[0]["saved_step"] if pre else None
    b_restored = b.of("restored")[0]["step"] if b.of("restored") else None
    out.append(
        Check(
            "SIGTERM: emergency save, exact resume",
            "sigterm" in kinds and saved is not None and a.rc != 0 and b_restored == saved,
            f"saved step {saved}, workers exited {pre[0]['code'] if pre else '-'}, torchrun {_exit(a.rc)}; "
            f"relaunch resumed at {b_restored}",
        )
    )
    c_rest = c.of("restored")[0] if c.of("restored") else {}
    fallbacks = c.of("fallback")
    hit = next((f["step"] for f in r.faults if f["kind"] == "corrupt"), -1)
    older = max((s["step"] for s in r.saves if s["step"] < hit), default=None)
    out.append(
        Check(
            "corrupt newest: warns, falls back",
            len(fallbacks) == 1
            and re.search(rf"\bstep {hit}\b", fallbacks[0]["message"]) is not None
            and c_rest.get("step") == older,
            f"warned: {_reason(fallbacks[0]['message']) if fallbacks else 'nothing'}; resumed at "
            f"{c_rest.get('step')} (previous intact: {older})",
        )
    )
    out.append(
        Check(
            "2 -> 1 ranks: DCP reshards",
            c_rest.get("world_size") == 1 and c_rest.get("saved_world_size") == 2 and c.rc == 0,
            f"saved by {c_rest.get('saved_world_size')} ranks, restored on {c_rest.get('world_size')}",
        )
    )
    snaps = r.snapshots
    same2, diff2, n2 = compare(snaps["run_resize"], snaps["ref_resize"])
    out.append(
        Check(
            f"bitwise at step {sch['resize_at']} (2 ranks)",
            same2 and n2 > 0,
            f"{n2} tensors (model + AdamW state) vs uninterrupted 2-rank reference: "
            + ("identical" if same2 else f"DIFFER, max abs diff {diff2:.3g}"),
        )
    )
    same1, diff1, n1 = compare(snaps["run_end"], snaps["ref1_end"])
    out.append(
        Check(
            f"bitwise at step {sch['steps']} (after 2 -> 1)",
            same1 and n1 > 0,
            f"{n1} tensors vs a reference that went to 1 rank at step {c_rest.get('step')} without faults: "
            + ("identical" if same1 else f"DIFFER, max abs diff {diff1:.3g}"),
        )
    )
    _, diff_ws, _ = compare(snaps["run_end"], snaps["ref_end"])
    facts = {
        "max_abs_diff_vs_2rank_throughout": diff_ws,
        "restarts": len(segs) - 1,
        "fallbacks": sum(len(launch.of("fallback")) for launch in runs),
        "world_sizes": [s.world for s in segs],
    }
    return out, facts


def _exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            pass
    return f"exited {rc}"


def _reason(message: str) -> str:
    """The restore warning without its fixed prefix and suffix: step, file and what is wrong."""
    message = message.removeprefix("safepoint: skipping corrupt checkpoint: ")
    return message.removesuffix("; falling back to an older one")


LOOP_WINDOW = 10
"""Steps on each side of a save whose (save-free) step times make its baseline."""


def loop_costs_ms(launch: LaunchResult) -> list[float]:
    """What each periodic save cost the training loop, as rank 0 felt it: the wall time from the saved
    step to the next, less the median step time of up to LOOP_WINDOW save-free steps on each side.

    The blocking time a save reports is what safepoint measured of itself; this is what the loop saw
    (a stall outside the measured call, e.g. waiting on a process start, shows here and not there).
    Steps are compared within one torchrun attempt (a restarted attempt repeats step numbers), and a
    step where the job waited for the demo's fault (kill-ready, preempt-ready) is no baseline."""
    costs = []
    for attempt in sorted({e.get("attempt", 0) for e in launch.events}):
        mine = [e for e in launch.events if e.get("attempt", 0) == attempt and e["rank"] == 0]
        times = {e["step"]: e["t"] for e in mine if e["event"] == "step"}
        saved = {e["step"] for e in mine if e["event"] == "save"}
        waited = {e["step"] for e in mine if e["event"] in ("kill-ready", "preempt-ready")}
        gaps = {s: times[s + 1] - times[s] for s in times if s + 1 in times and s not in waited}
        for s in sorted(saved):
            if s not in gaps:
                continue  # the attempt ended (or was stopped) right after this save
            near = [g for n, g in gaps.items() if 0 < abs(n - s) <= LOOP_WINDOW and n not in saved]
            if near:
                costs.append(max(0.0, gaps[s] - statistics.median(near)) * 1000)
    return costs


def stats(r: Report, segs: list[Segment]) -> dict[str, Any]:
    runs = [launch for launch in r.launches if launch.role == "run"]
    periodic = [e["blocking_ms"] for launch in runs for e in launch.of("save")]
    emergency = [
        e["blocking_ms"]
        for launch in runs
        for e in launch.of("preempted")
        if e.get("blocking_ms") is not None
    ]
    rates = [s["bytes"] / s["write_s"] / 1e6 for s in r.saves if s.get("write_s")]
    felt = [c for launch in runs for c in loop_costs_ms(launch)]
    lost = [max(0, prev.reached - seg.restored) for prev, seg in itertools.pairwise(segs)]
    ref = next(launch for launch in r.launches if launch.name == "reference")
    return {
        "saves": len(periodic) + len(emergency),
        "periodic_saves": len(periodic),
        "emergency_saves": len(emergency),
        "blocking_ms_mean": statistics.fmean(periodic) if periodic else None,
        "blocking_ms_max": max(periodic, default=None),
        "emergency_blocking_ms": emergency[0] if emergency else None,
        "loop_cost_ms_mean": statistics.fmean(felt) if felt else None,
        "loop_cost_ms_max": max(felt, default=None),
        "checkpoint_mb": statistics.fmean(s["bytes"] for s in r.saves) / 1e6 if r.saves else None,
        "write_mb_s": statistics.fmean(rates) if rates else None,
        "restarts": len(segs) - 1,
        "steps_lost": sum(lost),
        "steps_lost_per_restart": lost,
        "steps_executed": sum(len(launch.of("step")) for launch in runs),
        "fallbacks": sum(len(launch.of("fallback")) for launch in runs),
        "faulty_wall_s": runs[-1].t_end - runs[0].t_start,
        "reference_wall_s": ref.t_end - ref.t_start,
        "total_wall_s": r.wall_s,
    }


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def tables(r: Report, segs: list[Segment], st: dict[str, Any], cks: list[Check]) -> list[Table]:
    faults = Table(title="fault schedule (faulty run)", title_justify="left")
    for col in ("generation", "ranks", "resumed at", "ran to", "how it ended", "steps re-done"):
        faults.add_column(
            col, justify="right" if col in ("ranks", "resumed at", "ran to", "steps re-done") else "left"
        )
    endings = _endings(r, segs)
    lost = [0, *st["steps_lost_per_restart"]]
    for seg, end, n in zip(segs, endings, lost, strict=False):
        faults.add_row(
            f"{seg.launch}.{seg.attempt}", str(seg.world), str(seg.restored), str(seg.reached), end, str(n)
        )
    saves = Table(title="checkpointing", title_justify="left")
    saves.add_column("")
    saves.add_column("value", justify="right")
    rows = [
        ("saves (periodic + emergency)", f"{st['periodic_saves']} + {st['emergency_saves']}"),
        (
            "blocking ms, async saves (mean / max)",
            f"{_fmt(st['blocking_ms_mean'])} / {_fmt(st['blocking_ms_max'])}",
        ),
        (
            "step-time cost felt by the loop, ms (mean / max)",
            f"{_fmt(st['loop_cost_ms_mean'])} / {_fmt(st['loop_cost_ms_max'])}",
        ),
        ("blocking ms, emergency save (sync)", _fmt(st["emergency_blocking_ms"])),
        ("checkpoint size MB", _fmt(st["checkpoint_mb"], ".2f")),
        ("write MB/s (background, per save)", _fmt(st["write_mb_s"])),
        ("restarts (torchrun + relaunches)", str(st["restarts"])),
        ("steps lost (re-done)", f"{st['steps_lost']} of {st['steps_executed']} executed"),
        ("fallbacks to an older checkpoint", str(st["fallbacks"])),
        (
            "wall s: faulty run / reference / demo",
            f"{st['faulty_wall_s']:.1f} / {st['reference_wall_s']:.1f} / {st['total_wall_s']:.1f}",
        ),
    ]
    for k, v in rows:
        saves.add_row(k, v)
    verdict = Table(title="checks", title_justify="left")
    verdict.add_column("")
    verdict.add_column("check")
    verdict.add_column("measured")
    for ck in cks:
        verdict.add_row("[green]ok[/]" if ck.ok else "[bold red]FAIL[/]", ck.name, ck.detail)
    return [faults, saves, verdict]


def _endings(r: Report, segs: list[Segment]) -> list[str]:
    by_name = {launch.name: launch for launch in r.launches}
    out = []
    for seg in segs:
        evs = [e for e in by_name[seg.launch].events if e["attempt"] == seg.attempt]
        if any(e["event"] == "kill-ready" for e in evs) and any(f["kind"] == "sigkill" for f in r.faults):
            out.append("rank 1 SIGKILLed")
        elif any(e["event"] == "preempted" for e in evs):
            pre = next(e for e in evs if e["event"] == "preempted")
            out.append(f"SIGTERM: saved step {pre['saved_step']}, exit {pre['code']}")
        elif seg.launch == "B":
            out.append(f"done; then step {r.schedule['resize_at']} corrupted")
        else:
            out.append("done")
    return out


def goodput(r: Report, segs: list[Segment], st: dict[str, Any]) -> tuple[RunReport | None, list[Check]]:
    """`safepoint report` of the faulty run's root, checked against what the demo saw from outside."""
    if r.run_root is None:
        return None, []
    rep = build_report(r.run_root)
    ok = (len(rep.attempts), rep.steps_redone) == (len(segs), st["steps_lost"])
    ok = ok and rep.emergency_saves == st["emergency_saves"] and rep.saves >= st["saves"]
    detail = (
        f"report: {len(rep.attempts)} attempts, {rep.saves} saves, {rep.steps_redone} steps redone; demo: "
        f"{len(segs)} generations, {st['saves']} saves, {st['steps_lost']} steps lost"
    )
    return rep, [Check("`safepoint report` agrees with the demo", ok, detail)]


def finish(r: Report, out: Path, console: Console) -> int:
    segs = segments([launch for launch in r.launches if launch.role == "run"])
    cks, facts = checks(r, segs)
    st = stats(r, segs)
    run_report, agree = goodput(r, segs, st)
    cks += agree
    for table in tables(r, segs, st, cks):
        console.print(table)
    ok = all(ck.ok for ck in cks)
    diff = facts["max_abs_diff_vs_2rank_throughout"]
    console.print(
        f"note: against the reference that stayed on 2 ranks to step {r.schedule['steps']}, the final "
        f"weights differ by up to {diff:.3g}, as expected: on 1 rank a step averages 8 samples, not 16."
    )
    png = out / "timeline.png"
    skipped = demo_plot.timeline(png, r.launches, r.faults, r.schedule)
    console.print(f"timeline: {png}" if skipped is None else f"timeline: not written ({skipped})")
    summary = {
        "verdict": "ok" if ok else "failed",
        "checks": [dataclasses.asdict(ck) for ck in cks],
        "stats": st,
        **facts,
        "schedule": r.schedule,
        "faults": r.faults,
        "segments": [dataclasses.asdict(s) for s in segs],
        "launches": [
            {k: v for k, v in dataclasses.asdict(launch).items() if k != "events"} for launch in r.launches
        ],
        "saves": r.saves,
        "timeline": str(png) if skipped is None else None,
        "goodput": run_report.to_json() if run_report is not None else None,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    with open(out / "events.jsonl", "w") as f:
        for launch in r.launches:
            for ev in launch.events:
                f.write(json.dumps(ev) + "\n")
    if ok:
        console.print(
            "[bold green]VERDICT: ok[/]: every fault survived; weights and optimizer state bitwise "
            "identical to the uninterrupted references"
        )
    else:
        console.print("[bold red]VERDICT: FAILED[/]: " + "; ".join(ck.name for ck in cks if not ck.ok))
    if run_report is not None:  # what it all cost, as any job's `safepoint report ROOT` says it
        console.print(
            f"\nwhat checkpointing and the faults cost the faulty run (safepoint report {r.run_root}):"
        )
        for line in report_lines(run_report):
            console.print(escape(line))
    return 0 if ok else 1
