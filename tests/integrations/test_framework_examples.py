"""examples/accelerate_train.py and examples/hf_trainer_train.py keep the examples' contract, run as real
processes stopped by real signals sent to the whole process group (DataLoader workers included):

- SIGTERM: the job saves the step it printed last and exits 143; no printed step is lost;
- kill -9: the restart's first step is the newest committed step + 1;
- every loss of the interrupted runs equals the uninterrupted run's, bit for bit (dropout on, two
  DataLoader workers drawing a random augmentation, the run crossing epoch boundaries);
- every root passes ``safepoint verify``.

The default suite runs one sequence per framework (SIGTERM mid-epoch, then kill -9, then the end); the slow
ones stop the runs at other moments (an epoch's last batch, the first step after a resume).

The uninterrupted reference run is ``python examples/<script>``, as a user runs it, once per script and flags
in a pytest process (the tests of a script share it); the interrupted runs are forked from the fork server of
tests/helpers/forkserver.py, which imported torch and the framework once: their losses equal the fresh
process's, bit for bit.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from safepoint.cli.main import main as safepoint_cli
from tests.helpers.example_runs import Run, committed_steps, run_example

STEPS, SAVE_EVERY = 20, 4  # 12 batches an epoch: the runs cross one epoch boundary
ACCELERATE = pytest.param("accelerate_train.py", (), id="accelerate")
TRAINER_LORA = pytest.param("hf_trainer_train.py", ("--lora",), id="hf_trainer-peft_lora")
TRAINER = pytest.param("hf_trainer_train.py", (), id="hf_trainer", marks=pytest.mark.slow)


def _check_losses(run: Run, reference: dict[int, str]) -> None:
    different = [(step, loss, reference[step]) for step, loss in run.losses if reference[step] != loss]
    assert different == [], f"(step, loss, uninterrupted loss): {different[:5]}"


_references: dict[tuple[str, tuple[str, ...]], dict[int, str]] = {}


def _assert_the_frozen_base_is_linked(root: Path) -> None:
    """Incremental saves through the Trainer (issue 26): the PEFT model's frozen base goes into a stable
    group at the second save and every later save of the run hard-links that file instead of writing it:
    the newest three steps hold the very same stable-group files (one inode each)."""
    newest = committed_steps(root)[-3:]
    groups = [
        {
            p.name: p.stat().st_ino
            for p in (root / f"step-{s}").glob("__0_*.distcp")
            if p.name != "__0_0.distcp"
        }
        for s in newest
    ]
    assert groups[0] and groups[0] == groups[1] == groups[2], groups


def reference_losses(
    script: str, args: tuple[str, ...], tmp_path_factory: pytest.TempPathFactory
) -> dict[int, str]:
    """The uninterrupted run of ``python examples/<script> args`` (a fresh interpreter), run once per pytest
    process and verified: step -> loss."""
    key = (script, args)
    if key not in _references:
        root = tmp_path_factory.mktemp("reference") / "ckpt"
        ref = run_example(script, root, *args, fresh=True)
        assert ref.returncode == 0, ref.stderr[-3000:]
        assert [step for step, _ in ref.losses] == list(range(1, STEPS + 1))
        assert committed_steps(root)[-1] == STEPS
        assert safepoint_cli(["verify", str(root), "--all"]) == 0
        if "--lora" in args:
            _assert_the_frozen_base_is_linked(root)
        _references[key] = dict(ref.losses)
    return _references[key]


def interrupted_sequence(
    script: str,
    flags: tuple[str, ...],
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    stops: list[tuple[int, int]],
    rerun: bool = False,
) -> None:
    args = ("--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *flags)
    reference = reference_losses(script, args, tmp_path_factory)

    root = tmp_path / "ckpt"
    resume_at = 0
    for stop, sig in stops:
        run = run_example(script, root, *args, stop_at=stop, sig=sig, step_sleep=0.2)
        assert run.first == resume_at + 1, run.stderr[-3000:]
        _check_losses(run, reference)
        newest = committed_steps(root)[-1]
        if sig == signal.SIGTERM:
            assert run.returncode == 143, run.stderr[-3000:]
            assert newest == run.last, "a step printed before the SIGTERM was not saved"
        else:
            assert run.returncode == -signal.SIGKILL
        resume_at = newest
    final = run_example(script, root, *args)
    assert final.returncode == 0, final.stderr[-3000:]
    assert (final.first, final.last) == (resume_at + 1, STEPS)
    _check_losses(final, reference)
    assert committed_steps(root)[-1] == STEPS
    assert safepoint_cli(["verify", str(root), "--all"]) == 0
    if not rerun:
        return
    # Run again on a finished root: nothing left to train, nothing printed.
    again = run_example(script, root, *args)
    assert (again.returncode, again.losses) == (0, []), again.stderr[-3000:]


# Four real runs of a job that imports torch and its framework (three forked): minutes on a loaded machine.
@pytest.mark.timeout(1200)
@pytest.mark.parametrize(("script", "flags"), [ACCELERATE, TRAINER_LORA, TRAINER])
def test_sigterm_then_kill9_resume_bit_for_bit(
    script: str, flags: tuple[str, ...], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    interrupted_sequence(
        script, flags, tmp_path, tmp_path_factory, [(7, signal.SIGTERM), (15, signal.SIGKILL)]
    )


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize(("script", "flags"), [ACCELERATE, TRAINER_LORA, TRAINER])
def test_stops_at_an_epoch_end_and_right_after_a_resume(
    script: str, flags: tuple[str, ...], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # 12: the last batch of epoch 0 (a SIGTERM save there resumes at the start of epoch 1); 13: the first
    # step after that resume; 17: mid-epoch, killed; 18: the first step after, stopped by SIGTERM.
    stops = [(12, signal.SIGTERM), (13, signal.SIGKILL), (17, signal.SIGKILL), (18, signal.SIGTERM)]
    interrupted_sequence(script, flags, tmp_path, tmp_path_factory, stops, rerun=True)
