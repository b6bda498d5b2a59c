"""A wrapper tensor (torchao's NF4/float8 kind) is checked by restore's real rule (torch.save and a
weights_only load, in memory) once per pickled structure, not at every save (data/restorable.py
``_WrapperVerdicts``): a frozen NF4 base was serialised and loaded back, every byte of it, at every save.
The verdict is never reused across a change of what restore would judge: the instance's metadata, its
attributes, or the allowlist."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import safepoint
from safepoint.data.restorable import restorable
from safepoint.errors import SaveError
from tests.helpers.holder import Holder
from tests.helpers.wrapper_tensor import WrapperTensor

BIG = 16 << 20  # bytes of the wrapper's inner tensor


class _Opaque:
    """Not plain data: restore's ``torch.load(weights_only=True)`` refuses it."""


class _Nf4(WrapperTensor):
    """Its own type: the verdicts are per process."""


@pytest.fixture
def allowed() -> Iterator[None]:
    with torch.serialization.safe_globals([_Nf4]):  # allowlisted, as torchao's types are
        yield


def _peak(fn: object) -> int:
    tracemalloc.start()
    try:
        fn()  # type: ignore[operator]
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_wrapper_is_copied_through_torch_save_once_not_at_every_save(allowed: None) -> None:
    w = _Nf4(torch.zeros(BIG // 4), {"block": 64})
    first = _peak(lambda: restorable({"w": w}))
    again = [_peak(lambda: restorable({"w": w})) for _ in range(3)]
    assert first >= BIG  # the real rule: the whole tensor through torch.save, in memory
    assert max(again) < BIG // 16, again  # then only its structure is pickled (no tensor bytes)
    other = _Nf4(torch.ones(BIG // 4), {"block": 64})  # other values, the same structure: trusted too
    assert _peak(lambda: restorable({"w": other})) < BIG // 16


def test_new_metadata_on_a_wrapper_already_accepted_is_judged_again(allowed: None) -> None:
    w = _Nf4(torch.zeros(8), {"block": 64})
    restorable({"w": w})
    w.meta = _Opaque()  # what restore refuses, on the same tensor
    with pytest.raises(SaveError, match="'w'"):
        restorable({"w": w})
    w.extra = _Opaque()  # type: ignore[attr-defined]  # an attribute of its own is pickled too (its __dict__)
    w.meta = {"block": 64}
    with pytest.raises(SaveError, match="'w'"):
        restorable({"w": w})


def test_a_verdict_is_forgotten_when_the_allowlist_changes() -> None:
    w = _Nf4(torch.zeros(8), {"block": 64})
    with torch.serialization.safe_globals([_Nf4]):
        restorable({"w": w})  # accepted while allowed
    with pytest.raises(SaveError, match="'w'"):  # no longer allowed: restore would refuse it
        restorable({"w": w})


def test_a_trusted_wrapper_still_saves_and_restores_bit_for_bit(tmp_path: Path, allowed: None) -> None:
    obj = Holder(_Nf4(torch.arange(6.0), {"block": 64}))
    state = safepoint.TrainState(objects={"o": obj}, rng=False)
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        for step in (1, 2, 3):  # the second and third saves reuse the first's verdict
            obj.v.packed.add_(1)
            mgr.save(step, state)
    back = Holder(_Nf4(torch.zeros(6), {"block": 64}))
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.restore(safepoint.TrainState(objects={"o": back}, rng=False)) == 3
    assert torch.equal(back.v.packed, torch.arange(6.0) + 3)


class _Revoked:
    """Allowlisted while the real rule judges it; its third pickle and any later one (the verdict being recorded) take it off
    the allowlist, as another thread leaving ``torch.serialization.safe_globals`` would."""

    pickles = 0

    def __reduce__(self) -> tuple[object, tuple[()]]:
        type(self).pickles += 1
        if type(self).pickles >= 3:
            kept = [g for g in torch.serialization.get_safe_globals() if g is not _Revoked]
            torch.serialization.clear_safe_globals()
            torch.serialization.add_safe_globals(kept)
        return (_Revoked, ())


def test_a_verdict_reached_under_an_allowlist_changed_since_is_not_kept() -> None:
    with torch.serialization.safe_globals([_Nf4, _Revoked]):
        w = _Nf4(torch.zeros(8), {"block": 64})
        w.extra = _Revoked()  # type: ignore[attr-defined]
        restorable({"w": w})  # accepted: _Revoked was allowlisted when the load judged it
        with pytest.raises(SaveError):  # restore now refuses it: the save must too
            restorable({"w": w})
