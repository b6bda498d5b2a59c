"""The adaptive save interval (save_every_seconds="auto"): Daly's formula, its bounds, the learned MTBF."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

import safepoint
from safepoint.policy.history import ATTEMPTS_NAME, RunHistory, summarize
from safepoint.policy.rules import AdaptiveInterval, AdaptiveSeconds, daly_interval, learned_mtbf
from safepoint.store.posix_layout import Layout
from tests.conftest import REPO
from tests.helpers.example_runs import run_job
from tests.helpers.train import Setup

MIN = 60.0
HOUR = 3600.0


def test_daly_reproduces_the_published_examples() -> None:
    # Daly (FGCS 2006): C = 5 min, M = 24 h -> ~117 min; M = 6 h -> ~57 min. The higher-order form
    # sqrt(2CM) * [1 + sqrt(C/2M)/3 + (C/2M)/9] - C gives 116.7 and 56.7 min. Young's sqrt(2CM) gives
    # 120 and 60, and the first-order sqrt(2CM) - C gives 115 and 55: neither reproduces them.
    assert daly_interval(5 * MIN, 24 * HOUR) / MIN == pytest.approx(116.69, abs=0.01)
    assert round(daly_interval(5 * MIN, 24 * HOUR) / MIN) == 117
    assert daly_interval(5 * MIN, 6 * HOUR) / MIN == pytest.approx(56.71, abs=0.01)
    assert round(daly_interval(5 * MIN, 6 * HOUR) / MIN) == 57
    young = math.sqrt(2 * 5 * MIN * 24 * HOUR) / MIN
    assert round(young) == 120 and round(young - 5) == 115


def test_daly_edges() -> None:
    assert daly_interval(2 * HOUR, 1 * HOUR) == 1 * HOUR  # C >= 2M: T = M
    assert daly_interval(0.0, HOUR) == 0.0
    assert daly_interval(1.0, HOUR) == pytest.approx(math.sqrt(2 * HOUR), rel=0.02)  # Young, for tiny C
    for bad in ((-1.0, HOUR), (1.0, 0.0), (math.inf, HOUR), (1.0, math.nan)):
        with pytest.raises(ValueError):
            daly_interval(*bad)


def test_choice_uses_the_median_of_recent_costs_and_the_bounds() -> None:
    cfg = AdaptiveInterval()
    first = cfg.choose([], 24 * HOUR)
    assert (first.seconds, first.cost_s, first.daly_s) == (300.0, None, None)  # initial, until measured
    assert "initial" in first.describe()
    # A slow first save (buffers allocated) does not dominate: C is the median of the last 5.
    c = cfg.choose([90.0, 5 * MIN, 5 * MIN, 5 * MIN, 4 * MIN, 6 * MIN], 24 * HOUR)
    assert c.cost_s == 5 * MIN and c.samples == 5
    assert c.seconds == pytest.approx(daly_interval(5 * MIN, 24 * HOUR)) and c.clamped is None
    text = c.describe()
    assert "C=300.000s" in text and "M=86400s given" in text and "last 5 save(s)" in text
    low = cfg.choose([0.01], HOUR)  # Daly: ~8.5 s -> the one-minute floor
    assert (low.seconds, low.clamped) == (60.0, "min") and low.daly_s == pytest.approx(8.5, abs=0.1)
    high = cfg.choose([20 * MIN], 30 * 24 * HOUR)  # Daly: ~10.6 h -> the 4 h cap
    assert (high.seconds, high.clamped) == (4 * HOUR, "max")
    with pytest.raises(ValueError, match="initial_s"):
        AdaptiveInterval(min_s=10, initial_s=5)
    with pytest.raises(ValueError, match="auto"):
        safepoint.CheckpointManager("x", save_every_seconds="often")
    with pytest.raises(TypeError, match=r"AdaptiveInterval\(mtbf_s="):
        safepoint.CheckpointManager("x", save_every_steps=5, mtbf_seconds=HOUR)
    with pytest.raises(ValueError, match="mtbf_s"):
        AdaptiveInterval(mtbf_s=-1)


def test_learned_mtbf_formula() -> None:
    assert learned_mtbf(0.0, 0, 24 * HOUR) == 24 * HOUR  # nothing seen: the prior
    assert learned_mtbf(48 * HOUR, 0, 24 * HOUR) == 72 * HOUR  # failure-free time raises it
    assert learned_mtbf(10 * HOUR, 9, 24 * HOUR) == pytest.approx(3.4 * HOUR)  # many failures: ~observed/n
    attempts: list[dict[str, Any]] = [
        {"start": 0.0, "end": 100.0, "outcome": "failed"},
        {"start": 110.0, "end": 200.0, "outcome": "preempted"},  # saved: nothing lost, not a failure
        {"start": 300.0, "end": 350.0, "outcome": "preempted-unsaved"},  # work lost: a failure
        {"start": 400.0, "end": 420.0, "outcome": "closed"},
        {"start": 500.0, "end": None, "outcome": "running"},  # the current attempt, counted live
    ]
    stats = summarize(attempts, started=500.0)
    assert (stats.observed_s, stats.failures, stats.attempts) == (260.0, 2, 5)


def _adaptive(mgr: safepoint.CheckpointManager) -> AdaptiveSeconds:
    [policy] = [p for p in mgr._schedule.policies if isinstance(p, AdaptiveSeconds)]
    return policy


CRASH = """
import os, signal, sys
sys.path[:0] = [{src!r}, {repo!r}]
import safepoint
from tests.helpers.train import Setup
s = Setup()
mgr = safepoint.CheckpointManager({root!r}, save_every_steps=1, save_every_seconds="auto")
s.step()
mgr.maybe_save(1, s.state())
os.kill(os.getpid(), signal.SIGKILL)   # dies without close(): the next attempt must count a failure
"""


def test_restarts_are_recorded_and_teach_the_mtbf(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    code = CRASH.format(src=str(REPO / "src"), repo=str(REPO), root=str(root))
    crashed = run_job(["-c", code], timeout=120)  # forked from the suite's fork server: a kill, not a start
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    step1_time = json.loads((root / "step-1" / "safepoint.json").read_text())["time"]

    cfg = AdaptiveInterval(prior_mtbf_s=10 * HOUR)
    s = Setup()
    with caplog.at_level(logging.INFO, logger="safepoint"):
        mgr = safepoint.CheckpointManager(root, save_every_seconds=cfg)
    choice = _adaptive(mgr).choice
    # The killed attempt: a failure, ended at its last checkpoint; C comes from that checkpoint's manifest.
    assert "learned: 1 failure(s)" in choice.mtbf_source and "over 2 attempt(s)" in choice.mtbf_source
    assert choice.mtbf_s == pytest.approx(10 * HOUR / 2, abs=60)  # (prior + seconds observed) / (1 + 1)
    assert choice.cost_s is not None and choice.cost_s > 0
    assert "save interval" in caplog.text and "learned: 1 failure(s)" in caplog.text
    history = json.loads((root / ATTEMPTS_NAME).read_text())["attempts"]
    assert history[0]["outcome"] == "failed" and history[0]["inferred"] is True
    assert history[0]["end"] == step1_time and history[1]["outcome"] == "running"

    # An exception out of the `with` block is a failure; a preemption whose save committed is not.
    with pytest.raises(RuntimeError), mgr:
        raise RuntimeError("loss is NaN")
    with safepoint.CheckpointManager(
        root, save_every_seconds="auto", preemption=safepoint.PreemptionOptions(signals=(signal.SIGTERM,))
    ) as m:
        os.kill(os.getpid(), signal.SIGTERM)
        s.step()
        with pytest.raises(safepoint.Preempted):
            m.maybe_save(2, s.state())
    with safepoint.CheckpointManager(root, save_every_seconds="auto"):
        pass
    outcomes = [a["outcome"] for a in json.loads((root / ATTEMPTS_NAME).read_text())["attempts"]]
    assert outcomes == ["failed", "failed", "preempted", "closed"]
    with safepoint.CheckpointManager(root, save_every_seconds="auto") as mgr:
        assert "learned: 2 failure(s)" in _adaptive(mgr).choice.mtbf_source


def test_unreadable_history_starts_over(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    root.mkdir()
    (root / ATTEMPTS_NAME).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="safepoint"):
        with safepoint.CheckpointManager(root, save_every_seconds="auto") as mgr:
            assert "learned: 0 failure(s)" in _adaptive(mgr).choice.mtbf_source
    assert "restart history starts over" in caplog.text
    assert len(RunHistory(Layout(root))._load()) == 1  # rewritten, readable again


def test_manager_saves_on_the_adaptive_interval(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Seconds instead of hours so the test runs: the same code path as the defaults.
    cfg = AdaptiveInterval(min_s=0.05, initial_s=0.3, max_s=30.0, mtbf_s=2.0)
    s = Setup()
    with caplog.at_level(logging.INFO, logger="safepoint"):
        mgr = safepoint.CheckpointManager(root, save_every_seconds=cfg)
        policy = _adaptive(mgr)
        assert policy.seconds == 0.3  # initial: nothing measured yet
        t0 = time.monotonic()
        step = 0
        while len(mgr.saves) < 3 and time.monotonic() - t0 < 20:
            s.step()
            step += 1
            time.sleep(0.005)
            mgr.maybe_save(step, s.state())
        mgr.close()
    assert len(mgr.saves) == 3
    # After each save, C is measured again and the interval is Daly's for it (clamped): the last choice was
    # made when two saves had been measured (the third ended the loop).
    chosen = [r.message for r in caplog.records if "save interval" in r.message]
    assert len(chosen) == 3 and "save interval 0.3s (initial" in chosen[0]
    assert "last 1 save(s); M=2s given" in chosen[1] and "last 2 save(s); M=2s given" in chosen[2]
    cost = (mgr.saves[0].blocking_s + mgr.saves[1].blocking_s) / 2  # the median of two
    assert policy.choice.cost_s == pytest.approx(cost)
    assert policy.seconds == pytest.approx(min(30.0, max(0.05, daly_interval(cost, 2.0))))
    assert f"C={cost:.3f}s" in chosen[2]
    # A restarted manager starts from the cost its predecessor recorded in the manifests.
    with safepoint.CheckpointManager(root, save_every_seconds=cfg) as again:
        assert _adaptive(again).choice.cost_s is not None
        assert _adaptive(again).choice.samples == 3


@pytest.mark.parametrize(
    "interval", [AdaptiveInterval(mtbf_s=HOUR), AdaptiveInterval(min_s=1.0, initial_s=1.0, mtbf_s=HOUR)]
)
def test_auto_interval_accepts_string_and_object(root: Path, interval: str | AdaptiveInterval) -> None:
    with safepoint.CheckpointManager(root, save_every_seconds=interval) as mgr:
        assert _adaptive(mgr).choice.mtbf_source == "given"


def test_the_owner_always_records_its_attempts(root: Path, tmp_path: Path) -> None:
    # The attempts file is the run's history for the learned MTBF and for `safepoint report` alike: every
    # owner of a local root records its attempt, whatever its save interval.
    with safepoint.CheckpointManager(root, save_every_seconds="auto"):
        pass
    names = sorted(p.name for p in root.iterdir())
    assert ATTEMPTS_NAME in names and not [n for n in names if n.endswith(".tmp")]
    for kw in ({"save_every_seconds": AdaptiveInterval(mtbf_s=HOUR)}, {"save_every_seconds": 60.0}, {}):
        other = tmp_path / f"other-{len(kw)}-{len(str(kw))}"
        with safepoint.CheckpointManager(other, **kw):
            pass
        outcomes = [a["outcome"] for a in json.loads((other / ATTEMPTS_NAME).read_text())["attempts"]]
        assert outcomes == ["closed"]
