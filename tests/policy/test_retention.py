"""Retention policies: pure functions of the history, and the manager applying them after each commit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import safepoint
from safepoint.cli.main import main
from safepoint.policy.rules import Retention
from safepoint.restore.restorer import CheckpointWarning
from safepoint.store.posix_layout import CheckpointInfo, Layout
from tests.helpers.train import Setup


def _hist(steps: list[int], losses: dict[int, float] | None = None) -> list[CheckpointInfo]:
    losses = losses or {}
    return [
        CheckpointInfo(
            step=s,
            path=f"/r/step-{s}",
            time=float(s),
            bytes=1,
            metrics={"loss": losses[s]} if s in losses else {},
        )
        for s in steps
    ]


def test_keep_last() -> None:
    r = safepoint.Keep(last=2).retention()
    assert r.to_delete(_hist([1, 2, 3, 4])) == [1, 2]


def test_keep_every_milestones_union_with_last() -> None:
    r = safepoint.Keep(last=1, every_steps=10).retention()
    assert r.to_delete(_hist([5, 10, 15, 20, 25])) == [5, 15]


def test_keep_best_never_evicts_newest() -> None:
    # Orbax's best_fn + max_to_keep evicted the newest checkpoint; ours must never.
    r = safepoint.Keep(best=safepoint.KeepBest(1, metric="loss")).retention()
    assert r.to_delete(_hist([1, 2, 3], {1: 0.1, 2: 0.5, 3: 0.9})) == [2]
    r = safepoint.Keep(best=safepoint.KeepBest(2, metric="acc", mode="max")).retention()
    hist = _hist([1, 2, 3, 4])
    hist = [
        CheckpointInfo(c.step, c.path, c.time, 1, {"acc": a})
        for c, a in zip(hist, [0.9, 0.1, 0.8, 0.2], strict=True)
    ]
    assert r.to_delete(hist) == [2]


def test_keep_best_ignores_checkpoints_without_metric() -> None:
    r = safepoint.Keep(best=safepoint.KeepBest(1, metric="loss")).retention()
    assert r.to_delete(_hist([1, 2, 3], {2: 0.3})) == [1]


def test_no_policy_keeps_everything() -> None:
    assert Retention().to_delete(_hist([1, 2, 3])) == []


@pytest.mark.parametrize(
    ("kwargs", "msg"),
    [
        (lambda: {"keep": safepoint.Keep(last=0)}, "Keep.last must be a positive int"),
        (lambda: {"keep": safepoint.Keep(every_steps=-5)}, "Keep.every_steps"),
        (lambda: {"keep": safepoint.Keep(last=True)}, "Keep.last"),  # type: ignore[arg-type]
        (lambda: {"keep": safepoint.Keep(local_last=0)}, "Keep.local_last"),
        (lambda: {"keep": safepoint.Keep(best=2)}, "Keep.best takes a safepoint.KeepBest"),  # type: ignore[arg-type]
        (lambda: {"keep": safepoint.Keep(best=safepoint.KeepBest(1, metric=""))}, "KeepBest.metric"),
        (lambda: {"keep": safepoint.Keep(best=safepoint.KeepBest(0, metric="loss"))}, "KeepBest.n"),
        (
            lambda: {"keep": safepoint.Keep(best=safepoint.KeepBest(1, metric="loss", mode="lowest"))},
            "KeepBest.mode must be",
        ),
        (lambda: {"save_every_steps": 0}, "save_every_steps"),
        (lambda: {"save_every_seconds": -1.0}, "save_every_seconds"),
    ],
)
def test_bad_arguments_name_the_argument(root: Path, kwargs: Any, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        safepoint.CheckpointManager(root, **kwargs())
    assert not root.exists() or not (root / ".lease").exists()


def test_keep_takes_a_keep_object(root: Path) -> None:
    with pytest.raises(TypeError, match="keep= takes a safepoint.Keep, got KeepLast"):
        safepoint.CheckpointManager(root, keep=safepoint.KeepLast(3))  # type: ignore[arg-type]
    assert not root.exists()


def test_keep_composes_the_policy_objects() -> None:
    best = safepoint.KeepBest(1, metric="loss")
    keep = safepoint.Keep(last=2, every_steps=10, best=best)
    assert keep.policies == (safepoint.KeepLast(2), safepoint.KeepEvery(10), best)
    assert safepoint.Keep().retention() == Retention()  # no rule: keep everything
    losses = {5: 0.1, 10: 0.5, 15: 0.9, 20: 0.8, 25: 0.7}
    assert keep.retention().to_delete(_hist([5, 10, 15, 20, 25], losses)) == [15]


@pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])
def test_manager_applies_retention_after_commit(root: Path, background: bool) -> None:
    s = Setup()
    cluster = safepoint.ClusterOptions(background_deletes=background)
    # The same state saved 7 times: incremental saves link its files, and with full copies retention would
    # also keep a step sharing no file with the newest (docs/reliability.md); full_every=0: the policies only.
    writer = safepoint.WriterOptions(full_every=0)
    with safepoint.CheckpointManager(
        root,
        cluster=cluster,
        keep=safepoint.Keep(last=2, every_steps=4, best=safepoint.KeepBest(1, metric="loss")),
        writer=writer,
    ) as mgr:
        losses = {1: 0.5, 2: 0.1, 3: 0.7, 4: 0.6, 5: 0.9, 6: 0.8, 7: 0.95}
        for step, loss in losses.items():
            mgr.save(step, s.state(), metrics={"loss": loss})
        if not background:  # inline: each save() returned after its deletes
            assert [c.step for c in mgr.list()] == [2, 4, 6, 7]
        mgr.wait()  # background (the default): retention runs on the deleter thread; wait() drains it
        assert [c.step for c in mgr.list()] == [2, 4, 6, 7]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        "step-2",
        "step-4",
        "step-6",
        "step-7",
    ]


# ---- the newest *verified* checkpoint survives (issue 13, finding 4) ------------------------------------


def _saved(root: Path, steps: list[int]) -> None:
    with safepoint.CheckpointManager(root) as mgr:
        for step in steps:
            mgr.save(step, safepoint.TrainState(rng=False, extra={"t": torch.arange(256.0) + step}))


def _rot(root: Path, step: int) -> None:
    """Flip one byte of the largest data file, as a failing disk would (size unchanged). (Here that is the
    rank's own file, which holds ``extra``; the DCP file holds nothing.)"""
    files = [p for p in (root / f"step-{step}").iterdir() if p.name not in ("safepoint.json", ".metadata")]
    data = max(files, key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_retention_keeps_the_newest_verified_and_the_one_just_saved(root: Path) -> None:
    _saved(root, [10, 20])
    _rot(root, 20)
    state = safepoint.TrainState(rng=False, extra={"t": torch.zeros(256)})
    with safepoint.CheckpointManager(root, keep=safepoint.Keep(last=1)) as mgr:
        with pytest.warns(CheckpointWarning, match="step 20"):
            assert mgr.restore(state) == 10
        mgr.save(15, state)
    steps = Layout(root).committed_steps()
    assert 10 in steps and 15 in steps  # was: [20] (the corrupt one), the next restart from 0
    with safepoint.CheckpointManager(root, keep=safepoint.Keep(last=1)) as mgr:
        with pytest.warns(CheckpointWarning, match="step 20"):
            assert mgr.restore(state) == 15


def test_prune_never_counts_a_corrupt_or_empty_checkpoint_as_the_newest(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _saved(root, [10, 20])
    _rot(root, 20)
    # A planted step whose manifest lists no files at all.
    planted = root / f"step-{10**20}"
    planted.mkdir()
    manifest = json.loads((root / "step-10" / "safepoint.json").read_text())
    manifest.update(step=10**20, files={})
    (planted / "safepoint.json").write_text(json.dumps(manifest))
    assert main(["prune", str(root), "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert "kept 1: [10]" in out and "step 20" in out, out
    assert 10 in Layout(root).committed_steps()
    state = safepoint.TrainState(rng=False, extra={"t": torch.zeros(256)})
    with safepoint.CheckpointManager(root) as mgr, pytest.warns(CheckpointWarning):
        assert mgr.restore(state) == 10
    assert torch.equal(state.extra["t"], torch.arange(256.0) + 10)  # type: ignore[index]
