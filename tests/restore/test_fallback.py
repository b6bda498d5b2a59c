"""A checkpoint found damaged while it is read (it verified, then a file changed) has already written into
the live state: the fallback to an older checkpoint must overwrite every key it wrote, or the restore fails
naming the keys that hold bytes of no verified checkpoint. It never returns with them in the state."""

from __future__ import annotations

import struct
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import safepoint
from safepoint.dist import Comm
from safepoint.restore.restorer import Restorer
from safepoint.state import TrainState
from safepoint.store.manifest import Manifest
from safepoint.store.posix_layout import Layout

_EMA = 1234.5  # a value found once in step 10's data file: the byte altered after verification


class _AlteredAfterVerify(Restorer):
    """Alters one byte of ``step``'s data file after it verified, right before it is read: what the
    reader's crc32c-while-reading is there to catch (a file replaced between verify and load)."""

    def __init__(self, layout: Layout, step: int) -> None:
        super().__init__(layout, Comm())
        self.step, self.done = step, False

    def load(self, manifest: Manifest, state: TrainState) -> None:
        if manifest.step == self.step and not self.done:
            self.done = True
            path = self.layout.step_path(self.step) / "__0_0.distcp"
            data = bytearray(path.read_bytes())
            at = data.find(struct.pack("<f", _EMA))
            assert at >= 0
            data[at + 3] ^= 0x40
            path.write_bytes(bytes(data))
        super().load(manifest, state)


def _linear(value: float) -> nn.Module:
    m = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        m.weight.fill_(value)
    return m


def _two_steps(root: Path, ema_in_step_5: bool) -> None:
    """Step 5, with or without the EMA (added to the run later), and step 10 with it."""
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(
            5,
            TrainState(
                model=_linear(1.0), modules={"ema": _linear(3.0)} if ema_in_step_5 else None, rng=False
            ),
        )
        mgr.save(10, TrainState(model=_linear(2.0), modules={"ema": _linear(_EMA)}, rng=False))


@pytest.mark.parametrize("path", ["restore_newest", "restore"])
def test_a_fallback_that_does_not_overwrite_what_the_damaged_load_wrote_fails_naming_it(
    root: Path, path: str
) -> None:
    _two_steps(root, ema_in_step_5=False)
    model, ema = _linear(0.0), _linear(0.0)
    state = TrainState(model=model, modules={"ema": ema}, rng=False)
    restorer = _AlteredAfterVerify(Layout(root), 10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(
            safepoint.CheckpointError, match=r"step 10.*step 5.*: modules\.ema\.weight\. Recreate"
        ) as e:
            if path == "restore_newest":
                restorer.restore_newest(state, None)
            else:
                restorer.restore(state, None, lambda below: restorer.choose(None, below))
    assert not isinstance(e.value, safepoint.CorruptCheckpointError)  # not a checkpoint to skip: the state
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("path", ["restore_newest", "restore"])
def test_a_fallback_that_overwrites_everything_the_damaged_load_wrote_succeeds(root: Path, path: str) -> None:
    _two_steps(root, ema_in_step_5=True)
    model, ema = _linear(0.0), _linear(0.0)
    state = TrainState(model=model, modules={"ema": ema}, rng=False)
    restorer = _AlteredAfterVerify(Layout(root), 10)
    with pytest.warns(safepoint.CheckpointWarning, match="step 10.*as read"):
        if path == "restore_newest":
            manifest = restorer.restore_newest(state, None)
        else:
            manifest = restorer.restore(state, None, lambda below: restorer.choose(None, below))
    assert manifest is not None and manifest.step == 5
    assert model.weight.eq(1.0).all() and ema.weight.eq(3.0).all()
