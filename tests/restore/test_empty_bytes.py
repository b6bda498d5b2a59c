"""``b""`` in a state: torch.save (pickle protocol 2) writes it as a call of the global ``bytes`` with no
arguments, which restore's ``torch.load(weights_only=True)`` refused: such a state was committed and no
restore could load it (found by tests/save/test_async_differential.py's campaign). Restore now allows that
one call, with no arguments only (store/reader.py ``_empty_bytes``): ``bytes(n)`` in a hostile record would
allocate n bytes, and is refused as unsafe, in one line."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

import safepoint
from safepoint.errors import UnsafeCheckpointError
from safepoint.store.reader import weights_only_load
from tests.helpers.holder import Holder


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_state_holding_empty_bytes_restores(tmp_path: Path, async_save: bool) -> None:
    value = {"empty": b"", "some": b"\x00x", "t": torch.arange(2.0), "nested": [b"", {"e": b""}]}
    with safepoint.CheckpointManager(tmp_path / "ckpt", async_save=async_save) as mgr:
        mgr.save(1, safepoint.TrainState(objects={"o": Holder(value)}, rng=False))
    back = Holder({"empty": b"?", "some": b"", "t": torch.zeros(2), "nested": [b"?", {"e": b"?"}]})
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.restore(safepoint.TrainState(objects={"o": back}, rng=False)) == 1
    assert back.v["empty"] == b"" and back.v["some"] == b"\x00x" and back.v["nested"] == [b"", {"e": b""}]
    assert torch.equal(back.v["t"], torch.arange(2.0))


class _Allocates:
    """A record that asks restore's load for ``bytes(1 << 40)``: a terabyte, were it allowed."""

    def __reduce__(self) -> tuple[type, tuple[int]]:
        return (bytes, (1 << 40,))


def test_bytes_with_an_argument_is_refused_as_unsafe_in_one_line() -> None:
    buf = io.BytesIO()
    torch.save(_Allocates(), buf)
    buf.seek(0)
    with pytest.raises(UnsafeCheckpointError) as e:
        weights_only_load(buf, "objects.o.v")
    assert "builtins.bytes" in str(e.value) and "\n" not in str(e.value)


def test_the_allowance_ends_with_the_load() -> None:
    buf = io.BytesIO()
    torch.save(b"", buf)
    assert weights_only_load(io.BytesIO(buf.getvalue()), "x") == b""
    assert all("bytes" not in repr(g) for g in torch.serialization.get_safe_globals())
    with pytest.raises(Exception, match="bytes"):  # torch's own load, outside restore, still refuses it
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
