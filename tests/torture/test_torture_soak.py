"""Soak: many save/restore cycles with retention (keep_last=2) leak nothing.

Run in a child of the torture zygote (a process of its own, so its descriptors, threads and RSS are
its own). Each cycle changes the model, saves, restores into a second model, checks they are equal and
that .pending is empty. Samples after the first ``every`` cycles are the baseline; at the end the open
descriptors (/proc/self/fd), Python threads (threading.active_count), OS threads (/proc/self/task) must
be exactly the baseline's and RSS must not have grown beyond allocator noise. Two patterns: one
long-lived manager, and a manager opened and closed every cycle (lease thread, process group, staging
buffers); sync and async.

Default: 50 cycles of each; ``-m slow``: 500.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.torture import checks
from tests.torture.harness import Zygote, shared_zygote

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Zygote:
    return shared_zygote(tmp_path_factory.getbasetemp())


def _soak(zygote: Zygote, cycles: int, async_save: bool, per_cycle_manager: bool) -> dict[str, Any]:
    every = max(5, cycles // 10)
    with checks.fast_dir("soak") as base:
        root = base / "ckpt"
        out = base / "out.json"
        args = {
            "root": str(root),
            "cycles": cycles,
            "async_save": async_save,
            "per_cycle_manager": per_cycle_manager,
            "every": every,
        }
        code = zygote.run({"scenario": "soak", "args": args, "out": str(out)}, timeout=1200)
        result: dict[str, Any] = json.loads(out.read_text())
    assert code == 0 and result["ok"], (result.get("message"), result.get("tb"), zygote.log_tail())
    samples = result["samples"]
    first, last = samples[0], samples[-1]
    growth = last["rss"] - first["rss"]
    checks.record_figures(
        f"soak-{cycles}-{'async' if async_save else 'sync'}-{'per-cycle' if per_cycle_manager else 'one'}-manager",
        cycles=cycles,
        fds=[first["fds"], last["fds"]],
        threads=[first["threads"], last["threads"]],
        tasks=[first["tasks"], last["tasks"]],
        rss_growth_mib=round(growth / MiB, 2),
    )
    assert [s["fds"] for s in samples] == [first["fds"]] * len(samples), "file descriptors leak"
    assert [s["threads"] for s in samples] == [first["threads"]] * len(samples), "Python threads leak"
    assert [s["tasks"] for s in samples] == [first["tasks"]] * len(samples), "OS threads leak"
    # The state is 130 KB (+ as much momentum): leaking one copy per cycle adds >= 13 MB over 50 cycles.
    assert growth <= 6 * MiB, f"RSS grew by {growth / MiB:.1f} MiB over {cycles} cycles: {samples}"
    assert result["pending_seen"] == [], "pending directories left behind"
    # Beside the last two steps, retention keeps the newest physical full copy (incremental saves share
    # files: docs/reliability.md), and the run's own records stay (attempts, journal; no progress file).
    steps = [n for n in result["dir"] if n.startswith("step-")]
    assert steps[-2:] == [f"step-{cycles - 1}", f"step-{cycles}"] and len(steps) <= 3, result["dir"]
    assert [n for n in result["dir"] if n not in steps] == [".attempts.json", ".journal.jsonl", ".pending"]
    return result


def test_soak_sync_one_manager(zygote: Zygote) -> None:
    _soak(zygote, 50, async_save=False, per_cycle_manager=False)


def test_soak_async_manager_per_cycle(zygote: Zygote) -> None:
    _soak(zygote, 50, async_save=True, per_cycle_manager=True)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize(
    ("async_save", "per_cycle_manager"),
    [(False, False), (True, True)],
    ids=["sync-one-manager", "async-manager-per-cycle"],
)
def test_soak_500_cycles(zygote: Zygote, async_save: bool, per_cycle_manager: bool) -> None:
    _soak(zygote, 500, async_save=async_save, per_cycle_manager=per_cycle_manager)
