"""Random SIGKILL campaigns against real training, with the exactness check at the end.

Single process (tests/torture/kills.py): a real training loop (dropout, every RNG in play) saving every
step with retention; killed at random moments aimed from its own begin/end-of-save lines. After each kill
this process restores and compares the state bitwise with an uninterrupted run at that step; at the end
a child resumes and trains to the last step, matching the uninterrupted run at every step. A child waits
at a gate before its last step until the harness has made every kill (tests/torture/scenarios.train), so
the kill count never depends on how fast the harness reads the child's lines; the last kill is always
made there.
(tests/save/test_crash.py has the campaign on step-filled tensors -- 20 kills, 200 with -m slow; this one adds
real training and bitwise exactness.)

Two ranks: ``torch.distributed.run --standalone --nproc-per-node=2`` (gloo, CPU) with --max-restarts; a
random rank is SIGKILLed at a random moment and torchrun restarts both. Every attempt must resume the
newest committed step (never older than a save both ranks finished), and the final model, optimizer, RNG
draws and data position must equal an uninterrupted run's, bitwise. The run's last step waits at a gate
until the harness has made every kill (tests/torture/dist_train.py), so the kill count never depends on how
fast the harness reads the ranks' logs; the last kill is always made there.

Default: 10 single-process kills, and 3 on a 2-step run, where the harness is behind the run for certain
(kills at the gate). ``-m slow``: 200 single-process kills; two ranks, 2 and 20 kills, and 3 on a 2-step
run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.torture import checks, kills
from tests.torture.harness import Zygote, shared_zygote


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Zygote:
    return shared_zygote(tmp_path_factory.getbasetemp())


def _single(zygote: Zygote, tmp_path: Path, n: int, seed: int, total: int | None = None) -> kills.KillResult:
    # The child cannot end before the n-th kill: its last step waits at the gate, and a kill the harness
    # has not made by then is made there. The step budget only decides where the kills land: 1-3 saves
    # after each resume when the harness keeps up, at the gate when it does not.
    total = 3 * n + 10 if total is None else total
    ref = kills.reference(zygote, tmp_path / "ref", total, tmp_path / "ref.pt")
    r = kills.single_process_campaign(zygote, tmp_path / "ckpt", ref, n, seed, tmp_path / "final.pt")
    checks.record_figures(
        f"kill-single-{n}",
        steps=total,
        kills=r.kills,
        gate_kills=r.gate_kills,
        restores=r.restores,
        lost=r.lost,
        corrupt=r.corrupt,
        violations=len(r.violations),
    )
    assert r.violations == []
    assert r.kills == n and r.lost == 0 and r.corrupt == 0, r
    assert r.restored_steps == sorted(r.restored_steps) and r.restored_steps[-1] > 0
    return r


def test_sigkill_real_training_is_exact(zygote: Zygote, tmp_path: Path) -> None:
    _single(zygote, tmp_path, 10, seed=3)


def test_single_process_kills_at_the_gate_are_exact(zygote: Zygote, tmp_path: Path) -> None:
    """The harness behind the run, made certain: with 2 steps a child is at the gate (before step 2) after
    its first save, and every kill after the first is made there, each child resuming step 1."""
    r = _single(zygote, tmp_path, 3, seed=8, total=2)
    assert r.gate_kills >= 2 and r.restored_steps == [1, 1, 1], r


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_sigkill_real_training_200_times(zygote: Zygote, tmp_path: Path) -> None:
    _single(zygote, tmp_path, 200, seed=4)


def _two_ranks(
    tmp_path: Path, n: int, seed: int, timeout: float, steps: int | None = None
) -> kills.DistResult:
    # The run cannot end before the n-th kill: its last step waits at the gate, and a kill the harness has
    # not made by then is made there. The step budget only decides where the kills land: an attempt
    # advances 1-4 steps before its kill when the harness keeps up, many more on a loaded machine where it
    # reads the ranks' logs late (CI once finished 36 steps after 2 of 3 kills); kills beyond the budget
    # hit the gate, with no save in flight. Steps are cheap (~50 ms).
    steps = 16 * n + 24 if steps is None else steps
    r = kills.dist_campaign(tmp_path / "dist", kills=n, seed=seed, steps=steps, timeout=timeout)
    checks.record_figures(
        f"kill-2rank-{n}",
        steps=steps,
        kills=r.kills,
        gate_kills=r.gate_kills,
        attempts=r.attempts,
        unplanned_restarts=r.unplanned_restarts,
        lost=r.lost,
        seconds=round(r.seconds, 1),
        violations=len(r.violations),
    )
    assert r.violations == []
    assert r.kills == n and r.lost == 0, r
    assert r.attempts >= n + 1
    return r


@pytest.mark.slow  # make test budget: torchrun kills and SIGTERMs also run by default in tests/dist and test_preemption_loader
@pytest.mark.timeout(300)
def test_two_rank_sigkill_and_torchrun_restart_are_exact(tmp_path: Path) -> None:
    _two_ranks(tmp_path, 2, seed=5, timeout=280)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_two_rank_sigkill_20_times(tmp_path: Path) -> None:
    _two_ranks(tmp_path, 20, seed=6, timeout=1100)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_rank_kills_at_the_gate_are_exact(tmp_path: Path) -> None:
    """The harness behind the run, made certain: with 2 steps the run is at the gate (before step 2) after
    its first save, and every kill after the first is made there, each attempt resuming step 1."""
    r = _two_ranks(tmp_path, 3, seed=7, timeout=280, steps=2)
    assert r.gate_kills >= 2, r
