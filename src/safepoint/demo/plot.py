"""The demo's PNG timeline: training steps against wall time, with saves, restores and faults marked.

matplotlib is optional (``pip install 'safepoint[plot]'``); without it the timeline is skipped.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from safepoint.demo.launch import LaunchResult

_FAULT_STYLE = {
    "sigkill": ("tab:red", "SIGKILL rank 1"),
    "sigterm": ("tab:orange", "SIGTERM (preemption)"),
    "corrupt": ("tab:purple", "newest checkpoint corrupted"),
    "resize": ("tab:cyan", "relaunch on 1 rank"),
}


# Plotting calls are long argument lists; one per line would drown the logic.
# fmt: off
def timeline(
    path: Path, launches: list[LaunchResult], faults: list[dict[str, Any]], schedule: dict[str, int]
) -> str | None:
    """Write the PNG; return None, or why it was not written."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: pip install 'safepoint[plot]'"

    runs = [launch for launch in launches if launch.role == "run"]
    ref = next(launch for launch in launches if launch.name == "reference")
    t0 = runs[0].t_start
    fig, ax = plt.subplots(figsize=(12, 5.5), dpi=110)
    ref_steps = ref.of("step")
    first = next((e for launch in runs for e in launch.of("restored")), None)
    # The reference drawn from the same starting point as the faulty run, so the two can be compared.
    shift = (first["t"] - t0 if first else 0.0) - (ref.of("restored") or [{"t": ref.t_start}])[0]["t"]
    ax.plot([e["t"] + shift for e in ref_steps], [e["step"] for e in ref_steps], color="0.5",
            linestyle="--", linewidth=1.2, label="reference: uninterrupted, 2 ranks")
    colors = {2: "tab:blue", 1: "tab:green"}
    labelled: set[str] = set()

    def once(label: str) -> str | None:
        if label in labelled:
            return None
        labelled.add(label)
        return label

    ends: list[tuple[float, float]] = []  # (first, last) time of each worker generation
    for launch in runs:
        # torchrun's restart happens inside launch A: plot each worker generation on its own.
        for attempt in sorted({e["attempt"] for e in launch.events}):
            steps = [e for e in launch.of("step") if e["attempt"] == attempt]
            restored = [e for e in launch.of("restored") if e["attempt"] == attempt]
            if restored:
                r = restored[0]
                ax.plot(r["t"] - t0, r["step"], marker="o", mfc="white", color="black", ms=6, zorder=4,
                        linestyle="none", label=once("restored (resumed at)"))
                steps = [{"t": r["t"], "step": r["step"]}, *steps]
            if steps:
                ends.append((steps[0]["t"] - t0, steps[-1]["t"] - t0))
            label = f"faulty run, {launch.world} rank{'s' if launch.world > 1 else ''}"
            ax.plot([e["t"] - t0 for e in steps], [e["step"] for e in steps], color=colors[launch.world],
                    linewidth=2, label=once(label))
            saves = [e for e in launch.of("save") if e["attempt"] == attempt]
            ax.plot([e["t"] - t0 for e in saves], [e["step"] for e in saves], marker="v", color="black",
                    ms=5, linestyle="none", label=once("save (async)"))
            for e in launch.of("preempted"):
                if e["attempt"] == attempt and e.get("saved_step") is not None:
                    ax.plot(e["t"] - t0, e["saved_step"], marker="*", color="tab:orange", ms=14,
                            linestyle="none", zorder=5, label=once("emergency save"))
    # Between generations: processes exiting, torchrun starting, Python importing torch, rendezvous.
    for (_, end), (start, _) in itertools.pairwise(ends):
        ax.axvspan(end, start, color="0.93", zorder=0, label=once("restart (new processes)"))
    for f in faults:
        color, label = _FAULT_STYLE[f["kind"]]
        style = "--" if f["kind"] == "resize" else "-"
        ax.axvline(f["t"] - t0, color=color, linewidth=1.5, linestyle=style, label=once(label))
        if f["kind"] == "corrupt":
            ax.plot(f["t"] - t0, f["step"], marker="X", color=color, ms=10, linestyle="none", zorder=5,
                    label=once(f"corrupted: step {f['step']}"))
    ax.axhline(schedule["resize_at"], color="0.85", linewidth=0.8, zorder=0)
    ax.set_xlabel("wall time (s since the faulty run started)")
    ax.set_ylabel("optimizer step")
    ax.set_title("safepoint demo: a 2-rank torchrun job through four faults")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None
# fmt: on
