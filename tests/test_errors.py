"""Bad input gets a clear error naming the problem, and loses nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

import safepoint
from tests.helpers.train import Setup


def test_wrong_model_lists_missing_unexpected_and_shapes(root: Path) -> None:
    s = Setup(width=16)
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, s.state())
        wider = Setup(width=32)
        with pytest.raises(
            safepoint.StateMismatchError,
            match=r"mismatched: .*model\.net\.0\.weight: checkpoint shape \(16, 8\) vs target \(32, 8\)",
        ):
            mgr.restore(wider.state())
        other = torch.nn.Sequential(torch.nn.Linear(8, 16))
        with pytest.raises(safepoint.StateMismatchError) as e:
            mgr.restore(safepoint.TrainState(model=other))
        msg = str(e.value)
        assert "missing from the checkpoint: model.0.bias, model.0.weight" in msg
        assert "in the checkpoint but not in the target: model.net.0.bias" in msg
        # Nothing was lost: the checkpoint still restores into the right model.
        assert mgr.restore(Setup(seed=3).state()) == 1


def test_missing_section_is_named(root: Path) -> None:
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, safepoint.TrainState(model=torch.nn.Linear(2, 2)))
        sched_owner = Setup()
        with pytest.raises(safepoint.StateMismatchError, match="has no 'optimizer' state"):
            mgr.restore(sched_owner.state())


@pytest.mark.parametrize(
    ("call", "msg"),
    [
        (lambda m, st: m.save(-1, st), "step must be a non-negative int"),
        (lambda m, st: m.save(1.5, st), "step must be"),
        (lambda m, st: m.save(1, {"model": 1}), "state must be a safepoint.TrainState"),
        (lambda m, st: m.maybe_save(1, st, metrics={"loss": "high"}), r"metrics\['loss'\] must be a number"),
        (lambda m, st: m.restore(st, step=-3), "step must be"),
    ],
)
def test_bad_call_arguments(root: Path, call: object, msg: str) -> None:
    with safepoint.CheckpointManager(root, save_every_steps=1) as mgr:
        with pytest.raises(ValueError, match=msg):
            call(mgr, safepoint.TrainState(model=torch.nn.Linear(2, 2)))  # type: ignore[operator]


@pytest.mark.parametrize(
    ("kwargs", "msg"),
    [
        ({"model": "resnet"}, "model=...\\) must be an nn.Module"),
        ({"optimizer": torch.nn.Linear(1, 1)}, "must be an Optimizer"),
        ({"scheduler": object()}, "needs state_dict"),
        ({"extra": {"f": lambda: 1}}, "JSON-able"),
        ({"extra": {1: 2}}, "keys must be strings"),
    ],
)
def test_trainstate_validation(kwargs: dict[str, object], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        safepoint.TrainState(**kwargs)  # type: ignore[arg-type]


def test_bad_root_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="root must be a non-empty path"):
        safepoint.CheckpointManager("")
    with pytest.raises(ValueError, match="unknown protocol 'gopher'"):
        safepoint.CheckpointManager("gopher://x/y")


def test_closed_manager(root: Path) -> None:
    mgr = safepoint.CheckpointManager(root)
    mgr.close()
    mgr.close()  # idempotent
    with pytest.raises(safepoint.CheckpointError, match="closed"):
        mgr.save(1, safepoint.TrainState())


def test_failed_save_commits_nothing_and_keeps_older(root: Path) -> None:
    st = safepoint.TrainState(model=torch.nn.Linear(2, 2))
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, st)
        # A real OS error inside DCP's writer: the pending area is a file, so mkdir fails. (chmod would not
        # stop root.)
        (root / ".pending").rmdir()
        (root / ".pending").write_text("in the way")
        with pytest.raises(
            safepoint.SaveError, match=r"save of step 2 failed and was not committed \(.*Error"
        ):
            mgr.save(2, st)
        (root / ".pending").unlink()
        assert [c.step for c in mgr.list()] == [1]
        assert mgr.restore(st) == 1


def test_an_async_save_whose_staging_fails_raises_the_save_error_a_sync_save_raises(root: Path) -> None:
    """A tensor the staging copy cannot read (here on ``meta``): the sync save raised SaveError, the async
    one the copy's raw NotImplementedError. Now both the same one line; nothing committed, one
    ``save_failed`` event, and the next save of a good state commits."""
    model = torch.nn.Linear(2, 2)
    good = safepoint.TrainState(model=model)
    model.register_buffer("lost", torch.empty(3, device="meta"))
    events: list[str] = []
    writer = safepoint.WriterOptions(async_writer="thread")
    with safepoint.CheckpointManager(
        root, async_save=True, writer=writer, on_event=lambda e: events.append(e.event_type)
    ) as mgr:
        for mode in ("sync", "async"):
            sync = mode == "sync"
            with pytest.raises(safepoint.SaveError) as e:
                (mgr._save_sync(1, good, {}) if sync else mgr.save(1, good))
            text = str(e.value)
            assert "save of step 1 failed and was not committed" in text, (mode, text)
            assert "meta" in text and "\n" not in text, (mode, text)
        assert events.count("save_failed") == 2, events
        assert mgr.list() == []
        del model.lost
        mgr.save(2, good)
        mgr.wait()
        assert [c.step for c in mgr.list()] == [2]


def test_exception_in_user_state_dict_commits_nothing(root: Path) -> None:
    class Broken:
        def state_dict(self) -> dict[str, object]:
            raise RuntimeError("sampler exploded")

        def load_state_dict(self, sd: dict[str, object]) -> None:
            pass

    with safepoint.CheckpointManager(root) as mgr:
        with pytest.raises(RuntimeError, match="sampler exploded"):
            mgr.save(1, safepoint.TrainState(dataloader=Broken()))
        assert mgr.list() == []


# ---- non-tensor items are checked at save time with restore's own rules (issue 13, finding 9) ----------


def test_numpy_scalar_hyperparameters_are_saved_as_python_numbers(tmp_path: Path) -> None:
    import numpy as np

    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=np.float64(1e-3))
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, safepoint.TrainState(model=model, optimizer=opt, rng=False))
    assert type(opt.param_groups[0]["lr"]) is np.float64  # the live optimizer is left as it was
    model2 = nn.Linear(4, 2)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:  # was: refused "not plain data"
        assert mgr.restore(safepoint.TrainState(model=model2, optimizer=opt2, rng=False)) == 1
    assert opt2.param_groups[0]["lr"] == 1e-3 and type(opt2.param_groups[0]["lr"]) is float


class _Opaque:
    pass


class _Scheduler:
    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": 3, "fn": _Opaque()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def test_an_item_restore_would_refuse_fails_the_save_at_once(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with safepoint.CheckpointManager(
        root, async_save=True, writer=safepoint.WriterOptions(async_writer="thread")
    ) as mgr:
        with pytest.raises(safepoint.SaveError, match=r"cannot save 'scheduler\.fn': a _Opaque .*tolist"):
            mgr.save(1, safepoint.TrainState(scheduler=_Scheduler(), rng=False))
        assert mgr.list() == []  # nothing committed, and the save failed in the caller, not later


def test_a_store_error_is_named_on_one_line_and_in_safepoints_words() -> None:
    """gcsfs raises ``OSError("Forbidden: <path>\\n<message>")``: a save's error is one line all the same;
    and where safepoint already said what failed (an UploadError whose cause is that OSError: "replacing
    committed step 3 failed midway ... finishes the replacement"), that sentence is kept, not swapped for
    the bare OSError under it."""
    from safepoint.errors import describe_exception
    from safepoint.remote.retry import UploadError

    forbidden = OSError("Forbidden: b/bkt/o/run%2Fstep-3\nno storage.objects.create access.")
    assert describe_exception(forbidden) == (
        "OSError: Forbidden: b/bkt/o/run%2Fstep-3 no storage.objects.create access."
    )
    try:
        try:
            raise forbidden
        except OSError as e:
            raise UploadError("replacing committed step 3 failed midway; the next save finishes it") from e
    except UploadError as e:
        assert describe_exception(e) == (
            "UploadError: replacing committed step 3 failed midway; the next save finishes it"
        )
    # An OSError under torch's "unexpected pos" RuntimeError is still the one named.
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError as e:
            raise RuntimeError("unexpected pos 704 vs 598") from e
    except RuntimeError as e:
        assert describe_exception(e) == "OSError: [Errno 28] No space left on device"


class _Point(NamedTuple):
    x: Any
    y: Any


class _WithTuple:
    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.value}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.value = sd["best"]


def test_a_namedtuple_is_refused_in_one_line_unless_allowlisted(tmp_path: Path) -> None:
    """A namedtuple's class is not among what ``torch.load(weights_only=True)`` rebuilds: the save fails at
    once naming it (it used to fail with a TypeError from building the class with no fields). Allowlisted
    with ``torch.serialization.add_safe_globals``, it is saved and restored as itself, a NumPy scalar in it
    as a Python number (it used to fail rebuilding the tuple from a list)."""
    import numpy as np

    root = tmp_path / "ckpt"
    with safepoint.CheckpointManager(root) as mgr:
        with pytest.raises(safepoint.SaveError, match=r"cannot save 'scheduler\.best': a _Point "):
            mgr.save(1, safepoint.TrainState(scheduler=_WithTuple(_Point(1.5, 2)), rng=False))
        assert mgr.list() == []
    with torch.serialization.safe_globals([_Point]):
        with safepoint.CheckpointManager(root) as mgr:
            mgr.save(1, safepoint.TrainState(scheduler=_WithTuple(_Point(np.float64(0.25), 2)), rng=False))
        back = _WithTuple(None)
        with safepoint.CheckpointManager(root) as mgr:
            assert mgr.restore(safepoint.TrainState(scheduler=back, rng=False)) == 1
    assert back.value == _Point(0.25, 2) and type(back.value) is _Point and type(back.value.x) is float
