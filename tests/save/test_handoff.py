"""What a save hands the writer process (save/handoff.py), and the process's answer to "same as last time".

The end-to-end behaviour (one full description for an unchanged state, a new one after a change of shape
or a restarted process) is checked in test_writer_process.py; here the pieces, with real DCP plans and a
real channel.
"""

from __future__ import annotations

import io
import os
import socket
import threading
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from safepoint.save import handoff, ipc, writer_child
from safepoint.save.shared_buffers import SharedArena, move_into_arena

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the process writer is Linux-only")


def _plan(sd: dict[str, object]) -> tuple[object, DefaultSavePlanner]:
    planner = DefaultSavePlanner()
    planner.set_up_planner(sd, is_coordinator=True)
    local = planner.create_local_plan()
    plans, _ = planner.create_global_plan([local])
    return planner.finish_plan(plans[0]), planner


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.size() == b.size()
        and a.stride() == b.stride()
        and a.untyped_storage().nbytes() == b.untyped_storage().nbytes()
        and bytes(a.untyped_storage()) == bytes(b.untyped_storage())
    )


@pytest.mark.parametrize(
    "t",
    [
        torch.tensor(3.5),
        torch.tensor(7, dtype=torch.int64),
        torch.tensor(True),
        torch.tensor(-0.0, dtype=torch.bfloat16),
        torch.tensor(float("nan"), dtype=torch.float16),
        torch.tensor(1 + 2j, dtype=torch.complex64),
        torch.zeros(0, 5),
        torch.zeros(5, 0, dtype=torch.int8),
        torch.ones(1),
        torch.arange(6.0).reshape(2, 1, 3),
    ],
    ids=["f32", "i64", "bool", "bf16-neg0", "f16-nan", "c64", "empty0x5", "empty5x0", "one", "2x1x3"],
)
def test_small_tensors_travel_as_raw_bytes_and_come_back_bitwise(t: torch.Tensor) -> None:
    value = handoff.value_of(t)
    assert value[0] == "raw"
    back = handoff.materialize_value(value)
    assert _same(back, t)


def test_tensors_that_are_not_their_own_plain_storage_travel_as_tensors() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    for t in (base.t(), base[1], base[:, :1]):
        value = handoff.value_of(t)
        assert value[0] == "tensor", t
        assert torch.equal(handoff.materialize_value(value), t.detach())
    assert handoff.materialize_value(handoff.value_of(io.BytesIO(b"abc"))).getvalue() == b"abc"
    with pytest.raises(handoff.HandoffError, match="cannot hand a str item"):
        handoff.value_of("x")


def test_a_description_matches_only_the_same_plan_places_and_segment() -> None:
    sd = {"a": torch.ones(4, 4), "b": torch.zeros(8), "step": torch.tensor(1.0), "x": io.BytesIO(b"1")}
    arena = move_into_arena(sd, pin=False)
    try:
        plan, planner = _plan(sd)
        places, values = handoff.describe(plan, planner, arena)  # type: ignore[arg-type]
        assert [p is None for p in places] == [False, False, True, True]  # DCP's order: sorted keys
        assert [v[0] for v in values] == ["raw", "bytes"]
        sent = handoff.Sent(1, plan, places, arena.id)  # type: ignore[arg-type]
        assert sent.matches(plan, list(places), arena.id)  # type: ignore[arg-type]
        again, _ = _plan(sd)
        assert again is not plan and sent.matches(again, places, arena.id)  # type: ignore[arg-type]
        assert not sent.matches(plan, places, "another-segment")  # type: ignore[arg-type]
        moved = [places[1], places[0], *places[2:]]  # the same items elsewhere in the segment
        assert not sent.matches(plan, moved, arena.id)  # type: ignore[arg-type]
        grown, _ = _plan({**sd, "c": torch.ones(4, 4)})  # a new parameter
        assert not sent.matches(grown, places, arena.id)  # type: ignore[arg-type]
        reshaped, _ = _plan({**sd, "a": torch.ones(2, 8)})
        assert not sent.matches(reshaped, places, arena.id)  # type: ignore[arg-type]
    finally:
        arena.release()


def test_the_process_answers_stale_to_a_description_it_does_not_hold(tmp_path: Path) -> None:
    """Every message gets exactly one reply, also "same as last time" for a key the process never got
    (a new process, or a desynchronised rank): "stale", and the channel stays in step."""
    arena = SharedArena.create(4096)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    served = threading.Thread(target=writer_child.serve, args=(theirs,), daemon=True)
    served.start()
    try:
        assert ipc.recv(mine)[0][0] == "ready"
        ipc.send(mine, ("again", 1, None, str(tmp_path), 1, []))
        assert ipc.recv(mine)[0] == ("stale",)
        ipc.send(mine, ("arena", arena.id, arena.nbytes), [arena.fd])
        assert ipc.recv(mine)[0] == ("ok",)
        ipc.send(mine, ("again", 1, arena.id, str(tmp_path), 1, []))
        assert ipc.recv(mine)[0] == ("stale",)
        ipc.send(mine, ("drop",))
        assert ipc.recv(mine)[0] == ("ok",)
    finally:
        mine.close()
        served.join(timeout=30)
        theirs.close()
        arena.release()
    assert not served.is_alive(), "serve must return when the channel closes"
