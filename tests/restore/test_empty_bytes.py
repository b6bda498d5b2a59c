"""``b""`` in a state: torch.save (pickle protocol 2) writes it as a call of the global ``bytes`` with no
arguments, which restore's ``torch.load(weights_only=True)`` refused: such a state was committed and no
restore could load it (found by tests/save/test_async_differential.py's campaign). Restore now allows that
one call, with no arguments only (store/reader.py ``_empty_bytes``): ``bytes(n)`` in a hostile record would
allocate n bytes, and is refused as unsafe, in one line."""

from __future__ import annotations

import io
import threading
import zipfile
from pathlib import Path
from typing import Any

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


class _PausingRecord(io.BytesIO):
    """A record whose tensor's bytes are read only once ``go`` is set (``inside`` says the load got there):
    its load is then inside restore's allowance, past ``{"t": ...}`` and before ``"b": b""``."""

    def __init__(self, raw: bytes, inside: threading.Event, go: threading.Event) -> None:
        super().__init__(raw)
        info = zipfile.ZipFile(io.BytesIO(raw)).getinfo("archive/data/0")
        self._span = range(info.header_offset, info.header_offset + 64 + info.compress_size)
        self._inside, self._go = inside, go

    def _pause(self) -> None:
        if self.tell() in self._span and not self._inside.is_set():
            self._inside.set()
            assert self._go.wait(60), "the other load never finished"

    def read(self, n: int | None = -1) -> bytes:
        self._pause()
        return super().read(n)

    def readinto(self, b: Any) -> int:
        self._pause()
        return super().readinto(b)


def test_a_load_ending_in_another_thread_leaves_the_allowance_to_a_load_still_running() -> None:
    """Two restores in two threads of one process: torch's allowlist is process-wide, and the first load to
    end took ``bytes`` away from the other, mid-record (its ``b""`` then refused as unsafe)."""
    buf = io.BytesIO()
    torch.save({"t": torch.arange(3.0), "b": b""}, buf)
    inside, go = threading.Event(), threading.Event()
    got: dict[str, Any] = {}

    def paused() -> None:
        try:
            got["paused"] = weights_only_load(_PausingRecord(buf.getvalue(), inside, go), "x")
        except Exception as e:  # reported below, in the test's thread
            got["paused"] = e

    t = threading.Thread(target=paused)
    t.start()
    try:
        assert inside.wait(60)
        assert weights_only_load(io.BytesIO(buf.getvalue()), "y")["b"] == b""  # starts and ends meanwhile
    finally:
        go.set()
        t.join(60)
    assert isinstance(got["paused"], dict), got["paused"]
    assert got["paused"]["b"] == b"" and torch.equal(got["paused"]["t"], torch.arange(3.0))
    assert all("bytes" not in repr(g) for g in torch.serialization.get_safe_globals())
