"""What benchmarks/bench_save.py reports: the raw runs, their summary against plain DCP, and the tables.

The tables read nothing but a result's JSON, so ``--render`` reprints an earlier run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from _common import (
    MiB,
    fmt,
    fmt_spread,
    machine_line,
    markdown_table,
    median,
    paired_ratios,
    print_table,
    quartiles,
)
from _save_variants import RESTORE_VARIANTS, SAVE_VARIANTS
from rich.console import Console

BASELINE = "dcp"
SAVE_TARGET = 0.95  # safepoint save throughput >= 0.95x plain DCP's
RESTORE_TARGET = 1.15  # safepoint restore time <= 1.15x plain DCP's


@dataclasses.dataclass
class Run:
    phase: str  # save | restore
    location: str  # disk | shm
    cache: str  # save: "-"; restore: cold | warm
    variant: str
    round: int
    position: int
    """Where in its round's order the variant ran (orders rotate from round to round)."""
    seconds: float
    cpu_s: float
    bytes: int
    loadavg_1m: float | None = None


def summarize(runs: list[Run], nbytes: int) -> list[dict[str, Any]]:
    """Per (phase, location, cache, variant): median/min/max seconds, MB/s, ratios vs plain DCP.

    Save ratios are throughput ratios (DCP time / variant time: > 1 is faster than DCP); restore ratios
    are time ratios (variant time / DCP time: < 1 is faster). ``paired_ratio`` is the median of the
    per-round ratios (robust to drift between rounds); ``ratio_of_medians`` is the plain ratio.
    """
    rows: list[dict[str, Any]] = []
    groups = sorted({(r.phase, r.location, r.cache) for r in runs}, key=lambda g: (g[0] != "save", g))
    for phase, location, cache in groups:
        group = [r for r in runs if (r.phase, r.location, r.cache) == (phase, location, cache)]
        secs: dict[str, dict[int, float]] = {}
        cpus: dict[str, dict[int, float]] = {}
        for r in group:
            secs.setdefault(r.variant, {})[r.round] = r.seconds
            cpus.setdefault(r.variant, {})[r.round] = r.cpu_s
        base, cpu_base = secs.get(BASELINE, {}), cpus.get(BASELINE, {})
        save = phase == "save"
        for variant in [v for v in (SAVE_VARIANTS if save else RESTORE_VARIANTS) if v in secs]:
            times = secs[variant]
            med = median(times.values())
            ratios = paired_ratios(times, base, (lambda t, b: b / t) if save else (lambda t, b: t / b))
            cpu_ratios = paired_ratios(cpus[variant], cpu_base, lambda c, b: c / b)
            row: dict[str, Any] = {
                "phase": phase,
                "location": location,
                "cache": cache,
                "variant": variant,
                "n": len(times),
                "median_s": med,
                "min_s": min(times.values()),
                "max_s": max(times.values()),
                "mb_s": nbytes / med / 1e6,
                "cpu_median_s": median(cpus[variant].values()),
                "ratio_of_medians": None,
                "paired_ratio": median(ratios) if ratios else None,
                "paired_ratio_q1_q3": quartiles(ratios) if ratios else None,
                "ratio_kind": "throughput x DCP" if save else "time x DCP",
                "cpu_paired_ratio": median(cpu_ratios) if cpu_ratios else None,
                "target": None,
                "met": None,
            }
            if base:
                base_med = median(base.values())
                row["ratio_of_medians"] = base_med / med if save else med / base_med
            if variant == "safepoint" and row["paired_ratio"] is not None:
                target = SAVE_TARGET if save else RESTORE_TARGET
                row["target"] = f"{'>=' if save else '<='} {target}"
                row["met"] = row["paired_ratio"] >= target if save else row["paired_ratio"] <= target
            rows.append(row)
    return rows


COLUMNS = (
    "where",
    "variant",
    "median s",
    "min s",
    "max s",
    "MB/s",
    "x DCP paired (q1-q3)",
    "x DCP medians",
    "cpu s",
    "cpu x DCP",
    "target",
)


def _cells(r: dict[str, Any], rich: bool) -> list[str]:
    verdict = ""
    if r["target"] is not None:
        met = ("[green]met[/]" if rich else "met") if r["met"] else ("[red]missed[/]" if rich else "missed")
        verdict = f"{r['target']}: {met}"
    return [
        r["location"] if r["cache"] == "-" else f"{r['location']} {r['cache']}",
        r["variant"],
        f"{r['median_s']:.3f}",
        f"{r['min_s']:.3f}",
        f"{r['max_s']:.3f}",
        f"{r['mb_s']:.0f}",
        fmt_spread(r["paired_ratio"], r["paired_ratio_q1_q3"]),
        fmt(r["ratio_of_medians"]),
        f"{r['cpu_median_s']:.2f}",
        fmt(r["cpu_paired_ratio"]),
        verdict,
    ]


def _caption(result: dict[str, Any], phase: str, n: int) -> str:
    kind = "throughput x DCP, higher is better" if phase == "save" else "time x DCP, lower is better"
    return (
        f"{phase} ({result['meta']['state']['bytes'] / MiB:.0f} MiB, {n} rounds; ratio = {kind}; "
        "cpu x DCP = CPU time ratio, lower is better)"
    )


def print_tables(console: Console, result: dict[str, Any]) -> None:
    console.print(machine_line(result["meta"]) + f"; page cache dropped: {result['meta'].get('drop_caches')}")
    for phase in ("save", "restore"):
        rows = [r for r in result["summary"] if r["phase"] == phase]
        if rows:
            print_table(
                console, _caption(result, phase, rows[0]["n"]), COLUMNS, [_cells(r, True) for r in rows]
            )


def markdown_tables(result: dict[str, Any]) -> str:
    """The summary as Markdown tables (what docs/benchmarks.md quotes)."""
    parts = []
    for phase in ("save", "restore"):
        rows = [r for r in result["summary"] if r["phase"] == phase]
        if rows:
            table = markdown_table(COLUMNS, [_cells(r, False) for r in rows])
            parts.append(f"**{_caption(result, phase, rows[0]['n'])}**\n\n{table}\n")
    return "\n".join(parts)
