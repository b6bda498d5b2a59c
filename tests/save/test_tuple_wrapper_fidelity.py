"""A wrapper tensor subclass (torchao's NF4Tensor) inside a value DCP pickles whole: an async save must
restore what a sync save restores (rev9c review).

A sync save pickles the tuple as it is: a wrapper's inner tensor keeps its storage offset and its *whole*
storage, and one storage for the wrapper's inner tensor and any other tensor of the value over it. The
async walk (save/pickled.py) staged a wrapper as an opaque item (save/wrappers.py: one packed buffer per
inner tensor), outside the value's storage map: the restore of an async save gave a packed inner tensor
(16 bytes at offset 0 for a view at offset 2 of a 24-byte storage) and two storages where the sync save's
gave one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from safepoint.save.staging import Stager
from tests.helpers.fidelity import canon, save_and_restore
from tests.helpers.wrapper_tensor import WrapperTensor

MODES = ["thread", "process"]


@pytest.fixture(autouse=True)
def _allowed() -> Iterator[None]:
    with torch.serialization.safe_globals([WrapperTensor]):
        yield


def _described(value: Any) -> Any:
    """``canon`` of a tuple with each wrapper described by its ``__dict__`` (its inner tensors, their
    views and storages: what ``canon`` compares), its class and its metadata."""
    return canon(tuple(("wrapper", x.__dict__) if isinstance(x, WrapperTensor) else x for x in value))


@pytest.mark.parametrize("mode", MODES)
def test_a_wrapper_in_a_tuple_keeps_its_inner_view_and_ties(tmp_path: Path, mode: str) -> None:
    def value() -> tuple[Any, ...]:
        x = torch.arange(6.0)
        return (WrapperTensor(x[2:], {"block": 1}), x, WrapperTensor(x, {"block": 2}))

    want = save_and_restore({"t": value()}, {"t": ()}, "sync", tmp_path / "sync")["t"]
    # The control: what the sync save restores is one storage of 24 bytes, the first view at offset 2.
    inner = want[0].packed
    assert inner.storage_offset() == 2 and inner.untyped_storage().nbytes() == 24
    assert inner.untyped_storage().data_ptr() == want[1].untyped_storage().data_ptr()
    assert want[2].packed.untyped_storage().data_ptr() == want[1].untyped_storage().data_ptr()
    got = save_and_restore({"t": value()}, {"t": ()}, mode, tmp_path / mode)["t"]
    assert _described(got) == _described(want)


def test_a_wrapper_in_a_tuple_is_rebuilt_over_the_kept_buffers_at_every_save(stager: Stager) -> None:
    # The buffers are the storages' (kept while they fit); the wrapper is rebuilt over them from the live
    # one at every save: an inner tensor replaced by a view of another storage of the same size, its
    # metadata changed, are what the next snapshot holds, and no later write to the live state reaches it.
    x = torch.arange(6.0)
    w = WrapperTensor(x[2:], {"block": 1})
    stager.stage({"t": (w, x)})
    y = torch.full((6,), 7.0)
    w.packed, w.meta = y[1:5], {"block": 2}
    snap = stager.stage({"t": (w, y)})["t"]
    assert stager.allocations == 1
    assert snap[0].meta == {"block": 2} and snap[0].meta is not w.meta
    assert snap[0].packed.storage_offset() == 1 and torch.equal(snap[0].packed, y[1:5])
    assert snap[0].packed.untyped_storage().data_ptr() == snap[1].untyped_storage().data_ptr()
    assert snap[1].untyped_storage().data_ptr() != y.untyped_storage().data_ptr()
    y.add_(1)
    w.meta["block"] = 3
    assert torch.equal(snap[1], torch.full((6,), 7.0)) and snap[0].meta == {"block": 2}
