"""`safepoint demo` is the product's promise in one command: every fault must really happen, the verdict
must be computed from the weights, and a failed comparison must fail the command."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from safepoint import demo_plot


@dataclass
class DemoRun:
    out: Path
    rc: int
    stdout: str
    summary: dict[str, Any]


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    out = tmp_path_factory.mktemp("demo") / "out"
    # A subprocess, as `make demo` runs it: the demo launches torchrun jobs of its own.
    proc = subprocess.run(
        [sys.executable, "-m", "safepoint.cli", "demo", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=540,
    )
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    return DemoRun(out, proc.returncode, proc.stdout + proc.stderr, summary)


@pytest.mark.timeout(600)
def test_demo_survives_every_fault_bitwise(quick_demo: DemoRun) -> None:
    d, s = quick_demo, quick_demo.summary
    assert d.rc == 0, d.stdout[-5000:]
    assert s["verdict"] == "ok"
    assert all(c["ok"] for c in s["checks"]), s["checks"]
    assert len(s["checks"]) == 6
    # Every fault really happened, as a process event the workers or the driver recorded.
    assert [f["kind"] for f in s["faults"]] == ["sigkill", "sigterm", "corrupt", "resize"]
    segs = s["segments"]
    assert [(g["launch"], g["attempt"], g["world"]) for g in segs] == [
        ("A", 0, 2),
        ("A", 1, 2),
        ("B", 0, 2),
        ("C", 0, 1),
    ]
    assert s["restarts"] == 3  # torchrun's own restart, the relaunch after SIGTERM, the 1-rank relaunch
    assert 0 < segs[1]["restored"] <= segs[0]["reached"]  # resumed from a checkpoint after the SIGKILL
    assert segs[2]["restored"] == segs[1]["reached"]  # the preempted step itself: nothing lost
    assert s["fallbacks"] == 1
    corrupt = s["faults"][2]["step"]
    assert segs[3]["restored"] < corrupt and "corrupt" in segs[3]["fallback"]
    assert s["world_sizes"] == [2, 2, 2, 1]
    st = s["stats"]
    assert st["periodic_saves"] >= 4
    assert st["emergency_saves"] == 1 and st["emergency_blocking_ms"] > 0
    assert st["steps_lost"] == sum(st["steps_lost_per_restart"]) > 0
    assert st["blocking_ms_mean"] > 0 and st["write_mb_s"] > 0
    # A different world size cannot be bitwise equal to the 2-rank reference; the demo says by how much.
    assert s["max_abs_diff_vs_2rank_throughout"] > 0
    for title in ("fault schedule", "checkpointing", "checks", "VERDICT: ok"):
        assert title in d.stdout
    assert (d.out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (d.out / "events.jsonl").stat().st_size > 0


@pytest.mark.timeout(600)
def test_demo_verdict_is_computed_from_the_weights(quick_demo: DemoRun) -> None:
    import torch

    from safepoint import demo_report

    run_end, ref_end = quick_demo.out / "run_end.pt", quick_demo.out / "ref1_end.pt"
    assert demo_report.compare(run_end, ref_end)[0]
    state = torch.load(run_end, weights_only=True)
    w = state["model"]["head.weight"]
    w.view(-1)[0] = torch.nextafter(w.view(-1)[0], torch.tensor(float("inf")))  # one ulp
    torch.save(state, quick_demo.out / "nudged.pt")
    identical, diff, n = demo_report.compare(quick_demo.out / "nudged.pt", ref_end)
    assert not identical and 0 < diff < 1e-6 and n > 0


def test_demo_timeline_is_skipped_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    note = demo_plot.timeline(tmp_path / "t.png", [], [], {})
    assert note is not None and "safepoint[plot]" in note
    assert not (tmp_path / "t.png").exists()


def test_demo_help_has_an_example() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "safepoint.cli", "demo", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0
    assert "safepoint demo --quick" in proc.stdout and "SIGKILL" in proc.stdout


def test_demo_refuses_to_replace_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("keep me")
    proc = subprocess.run(
        [sys.executable, "-m", "safepoint.cli", "demo", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "not the output of an earlier demo" in proc.stderr
    assert (tmp_path / "mine.txt").read_text() == "keep me"
