"""``safepoint report --plot FILE.png``: the run's timeline (attempts, saves, uploads, failures).

One row per kind of thing, against the seconds since the run's first start: the attempts as bars (colored
by how they ended, the redone part hatched), each save's loop-blocking span, each upload from the local
commit to durable, and the failures (failed saves, fallbacks, preemptions, attempts that were killed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safepoint import events as ev
from safepoint.errors import CheckpointError
from safepoint.policy.goodput import RunReport

_OUTCOME_COLOR = {"closed": "tab:green", "preempted": "tab:orange", "preempted-unsaved": "tab:red"}
_ROWS = ("attempts", "saves", "uploads", "failures")


# Plotting calls are long argument lists; one per line would drown the logic.
# fmt: off
def plot(report: RunReport, path: Path) -> None:
    """Write the timeline to ``path`` (CheckpointError if matplotlib is missing or it cannot be written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise CheckpointError("--plot needs matplotlib: pip install 'safepoint[plot]'") from None
    t0 = report.attempts[0].start if report.attempts else 0.0
    fig, ax = plt.subplots(figsize=(12, 3.8), dpi=110)
    y = {name: len(_ROWS) - 1 - i for i, name in enumerate(_ROWS)}
    for a in report.attempts:
        color = _OUTCOME_COLOR.get(a.outcome, "tab:gray" if a.outcome.startswith("running") else "tab:red")
        ax.barh(y["attempts"], a.end - a.start, left=a.start - t0, height=0.5, color=color, alpha=0.6,
                edgecolor="black")
        ax.text(a.start - t0, y["attempts"] + 0.3, a.outcome, fontsize=7)
        if a.outcome in ("killed", "running or killed", "failed"):
            ax.plot([a.end - t0], [y["failures"]], marker="X", color="black", linestyle="none")
        if a.redone_s:
            ax.barh(y["attempts"], a.redone_s, left=a.start - t0 - a.downtime_s - a.redone_s, height=0.5,
                    fill=False, hatch="//", edgecolor="tab:red")
    for r in report.records:
        _draw(ax, r, t0, y)
    ax.set_yticks([y[n] for n in _ROWS], list(_ROWS))
    ax.set_xlabel("seconds since the first start")
    ax.set_title(f"{report.root}: goodput {100 * report.goodput:.1f}%, {report.saves} saves, "
                 f"{report.restarts} restart(s), {report.steps_redone} step(s) redone", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise CheckpointError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def _draw(ax: Any, r: dict[str, Any], t0: float, y: dict[str, int]) -> None:
    kind, t = r["event_type"], r["wall_time"] - t0
    if kind == ev.SAVE:
        took = r.get("checkpoint_manager_blocking_duration_secs", 0.0)
        ax.barh(y["saves"], max(took, 1e-3), left=t - took, height=0.5, color="tab:blue")
    elif kind == ev.SAVE_DURABLE and r.get("tier") == "durable":
        lag = r.get("lag_secs", 0.0)
        ax.barh(y["uploads"], max(lag, 1e-3), left=t - lag, height=0.5, color="tab:purple", alpha=0.7)
    elif kind in (ev.SAVE_FAILED, ev.RESTORE_FALLBACK, ev.PREEMPTION):
        marker = {ev.SAVE_FAILED: "x", ev.RESTORE_FALLBACK: "v", ev.PREEMPTION: "D"}[kind]
        ax.plot([t], [y["failures"]], marker=marker, color="tab:red", linestyle="none")
# fmt: on
