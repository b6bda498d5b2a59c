"""SafepointCallback in process: a finished root trains nothing more, what the Trainer would get wrong after
a resume is refused with the numbers named, and the callback's inputs are checked."""

from __future__ import annotations

from pathlib import Path

import pytest

import safepoint

# transformers is imported inside each test (tests/integrations/hf_trainer_parts.py): every xdist worker
# imports this module to collect it, and only the one that runs it should pay for the framework.


def test_a_finished_root_trains_nothing_more(tmp_path: Path) -> None:
    from tests.integrations.hf_trainer_parts import train

    first = train(tmp_path, steps=4, save_every=3)  # 3 batches an epoch: step 4 is in epoch 1
    assert first.state.global_step == 4
    again = train(tmp_path, steps=4, save_every=3)
    assert again.state.global_step == 4  # restored, and no step past max_steps
    # The restored history, plus the end of this call (as after the Trainer's own resume): no step trained.
    assert [h["step"] for h in again.state.log_history if "train_loss" in h] == [4, 4]
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        assert [c.step for c in mgr.list()] == [3, 4]  # the periodic save and the final one


def test_accumulation_that_does_not_divide_the_epoch_is_refused_on_a_mid_epoch_resume(tmp_path: Path) -> None:
    from tests.integrations.hf_trainer_parts import SafepointCallback, StopAfterFirstSave, train, trainer

    # 20 samples / 4 = 5 batches an epoch; accumulating 2: the first save (step 1) is at batch 2 of epoch 0.
    with pytest.raises(KeyboardInterrupt):
        with safepoint.CheckpointManager(tmp_path / "ckpt", save_every_steps=1) as mgr:
            t = trainer(tmp_path, steps=6, accumulation=2, samples=20)
            SafepointCallback.attach(t, mgr)
            t.add_callback(StopAfterFirstSave())
            t.train()
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2 .* per epoch \(5\)"):
        train(tmp_path, steps=6, save_every=1, accumulation=2, samples=20)


def test_attach_checks_its_inputs(tmp_path: Path) -> None:
    from tests.integrations.hf_trainer_parts import SafepointCallback, trainer

    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        with pytest.raises(ValueError, match="needs a Trainer"):
            SafepointCallback.attach(object(), mgr)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="needs a CheckpointManager"):
            SafepointCallback.attach(trainer(tmp_path, 1), object())  # type: ignore[arg-type]


def test_callbacks_hear_of_an_async_save_only_once_it_is_committed(tmp_path: Path) -> None:
    from tests.integrations.hf_trainer_parts import SafepointCallback, SaveRecorder, trainer

    recorder = SaveRecorder()
    with safepoint.CheckpointManager(tmp_path / "ckpt", save_every_steps=2, async_save=True) as mgr:
        t = trainer(tmp_path, steps=5)
        SafepointCallback.attach(t, mgr)
        t.add_callback(recorder)
        t.train()
        assert [c.step for c in mgr.list()] == [2, 4, 5]
    assert recorder.seen == [(s, f"step-{s}", True) for s in (2, 4, 5)]
