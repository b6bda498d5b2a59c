"""What a restored state is, down to the bits, for comparing two restores of one state (sync vs async).

``canon`` describes a value as nested tuples that compare equal exactly when the two values are the same
to anything that reads them: container types and order, floats by their bits (a NaN's payload too),
tensors by class, dtype, shape, strides, storage offset, the bytes of their whole storage (what
``torch.save`` keeps of a view), conj/neg bits and ``requires_grad``, and ties: an object met twice is
described as the first one's number, two tensors over one storage name the same storage number.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import torch

import safepoint
from tests.helpers.holder import Holder

_SCALARS = (bool, int, str, bytes, type(None))


def canon(value: Any) -> Any:
    ids: dict[int, int] = {}
    storages: dict[int, int] = {}

    def storage_bytes(t: torch.Tensor) -> bytes:
        st = t.untyped_storage()
        return torch.empty(0, dtype=torch.uint8).set_(st).numpy().tobytes() if st.nbytes() else b""

    def go(v: Any) -> Any:
        kind = type(v)
        if kind in _SCALARS:
            return (kind.__name__, v)
        if kind is float:
            return ("float", struct.pack("<d", v))
        if id(v) in ids:
            return ("same", ids[id(v)])
        ids[id(v)] = len(ids)
        if isinstance(v, torch.Tensor):
            st = v.untyped_storage()
            # A storage of no bytes has no address to tell it apart by (every one is at 0).
            where = storages.setdefault(st.data_ptr(), len(storages)) if st.nbytes() else None
            return (
                kind.__name__, v.dtype, tuple(v.shape), v.stride(), v.storage_offset(), st.nbytes(), where,
                v.requires_grad, v.is_conj(), v.is_neg(), v.device.type, storage_bytes(v),
            )  # fmt: skip
        if isinstance(v, dict):
            return (kind.__name__, [(go(k), go(x)) for k, x in v.items()], go(getattr(v, "__dict__", None)))
        if isinstance(v, (list, tuple)):
            return (kind.__name__, [go(x) for x in v])
        return (kind.__name__, repr(v))

    return go(value)


def save_and_restore(value: Any, template: Any, mode: str, root: Path) -> Any:
    """``value`` saved (``mode``: "sync", or an async save with the "thread" or "process" writer) through
    the public API into ``root`` (a new one), then restored into ``template``: what the restore gave."""
    writer = safepoint.WriterOptions(async_writer="thread" if mode == "sync" else mode)
    state = safepoint.TrainState(objects={"o": Holder(value)}, rng=False)
    with safepoint.CheckpointManager(root, async_save=mode != "sync", writer=writer) as mgr:
        if mode == "process":
            process = mgr._process
            assert process is not None
            process.wait_ready()  # the process writes the save, not the thread while it starts
        mgr.save(1, state)
        mgr.wait()
    back = Holder(template)
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(objects={"o": back}, rng=False)) == 1
    return back.v
