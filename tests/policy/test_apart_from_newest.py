"""Retention's fallback rule (policy/retainer.py ``_apart_from_newest``: keep the newest step that shares no
file with the newest) stats the files of the steps it compares only where its answer can be a step: that
needs one step sharing a file with the newest and one sharing none, two besides the newest."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

import safepoint
from safepoint.policy import retainer


def _saves(root: Path, last: int, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    stated: list[int] = []
    real = retainer.file_identities
    monkeypatch.setattr(
        retainer,
        "file_identities",
        lambda layout, step, names: stated.append(step) or real(layout, step, names),
    )
    model = nn.Linear(8, 8)
    state = safepoint.TrainState(model=model, rng=False)
    with safepoint.CheckpointManager(
        root, keep=safepoint.Keep(last=last), writer=safepoint.WriterOptions(full_every=3)
    ) as mgr:
        for step in range(1, 8):
            mgr.save(step, state)
            mgr.wait()  # each pass before the next save: a pass that found two commits would see three steps
    return stated


def test_keep_last_one_stats_no_step(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _saves(root, 1, monkeypatch) == []
    assert sorted(p.name for p in root.glob("step-*")) == ["step-7"]


def test_with_more_steps_the_rule_still_keeps_a_step_apart(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _saves(root, 2, monkeypatch) != []
    steps = sorted(int(p.name[5:]) for p in root.glob("step-*"))
    newest = {f.stat().st_ino for f in (root / f"step-{steps[-1]}").iterdir()}
    apart = [
        s for s in steps[:-1] if newest.isdisjoint(f.stat().st_ino for f in (root / f"step-{s}").iterdir())
    ]
    assert apart, steps  # one damaged shared file always leaves an intact step (docs/reliability.md)
