"""What a save hands the writer process (save/handoff.py), and the process's answer to "same as last time".

The end-to-end behaviour (one full description for an unchanged state, a new one after a change of shape
or a restarted process) is checked in test_writer_process.py; here the pieces, with real DCP plans and a
real channel.
"""

from __future__ import annotations

import dataclasses
import io
import os
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType

from safepoint.save import handoff, ipc, writer_child
from safepoint.save.plan_reuse import PlanRecord, ReusingSavePlanner
from safepoint.save.shared_buffers import SharedArena, move_into_arena
from safepoint.save.staging import Stager

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the process writer is Linux-only")


def _plan(sd: dict[str, Any]) -> tuple[object, DefaultSavePlanner]:
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
    sd = {
        "a": torch.ones(4, 4),
        "b": torch.zeros(8),
        "e": torch.zeros(0),
        "step": torch.tensor(1.0),
        "x": io.BytesIO(b"1"),
    }
    arena = move_into_arena(sd, pin=False)
    try:
        plan, planner = _plan(sd)
        places, values = handoff.describe(plan, planner, arena)  # type: ignore[arg-type]
        # DCP's order: sorted keys. The 0-d step lies in the segment too; a zero-size tensor has no bytes.
        assert [p is None for p in places] == [False, False, True, False, True]
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


def test_one_element_tensors_move_into_the_segment_with_their_values() -> None:
    """Adam's 0-d ``step`` (one per parameter) lies in the staging segment, so a steady save sends nothing
    for it; its value is kept (a 0-d DTensor's private copy holds the live value when it moves)."""
    base = torch.arange(6.0)
    bufs = {
        "step": torch.tensor(5.0),
        "one": torch.tensor([7], dtype=torch.int64),
        "half": torch.tensor(-0.0, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 3),
        "view": base[2:3],  # one element of another storage: moving it would change ``base``'s bytes
        "w": torch.empty(3, 3),
    }
    before = {k: v.clone() for k, v in bufs.items()}
    arena = move_into_arena(bufs, pin=False)
    try:
        for key in ("step", "one", "half", "w"):
            assert handoff.place_of(bufs[key], arena) is not None, key
        for key in ("step", "one", "half"):
            assert _same(bufs[key], before[key]), key
            assert bufs[key].untyped_storage().nbytes() == bufs[key].element_size()
        assert handoff.place_of(bufs["empty"], arena) is None
        assert (
            handoff.place_of(bufs["view"], arena) is None and bufs["view"].data_ptr() == base.data_ptr() + 8
        )
        # The process's view of each item is its bytes in the segment (handoff.Held).
        plan, planner = _plan(bufs)
        places, _ = handoff.describe(plan, planner, arena)  # type: ignore[arg-type]
        held = handoff.Held.build(1, arena, plan, places)  # type: ignore[arg-type]
        for item in plan.items:  # type: ignore[attr-defined]
            if item.index.fqn in ("step", "one", "half"):
                assert _same(held.views[item.index], before[item.index.fqn])
    finally:
        arena.release()


class _Counting(ReusingSavePlanner):
    """safepoint's planner, counting the items resolved (what a description costs per item)."""

    resolved = 0

    def resolve_data(self, write_item: Any) -> Any:
        _Counting.resolved += 1
        return super().resolve_data(write_item)


def _adam_like(n: int) -> dict[str, Any]:
    params = {f"p{i}": torch.randn(4, 4) for i in range(n)}
    state = {i: {"step": torch.tensor(1.0), "exp_avg": torch.randn(4, 4)} for i in range(n)}
    return {
        "model": params,
        "optim": {"state": state, "param_groups": [{"lr": 0.1, "params": list(range(n))}]},
    }


def _planned(sd: dict[str, Any], record: PlanRecord) -> tuple[Any, _Counting]:
    """The plan a save of ``sd`` writes, through DCP's plan cache as the saver plans (one_process.py)."""
    planner = _Counting("test-handoff", record)
    planner.set_up_planner(sd, None, True)
    plans, _ = planner.create_global_plan([planner.create_local_plan()])
    return planner.finish_plan(plans[0]), planner


def _check(describer: handoff.Describer, live: dict[str, Any], stager: Stager, record: PlanRecord) -> Any:
    """One save's description by ``describer``, against describe() of every item; returns the plan."""
    snapshot = stager.stage(live)
    plan, planner = _planned(snapshot, record)
    _Counting.resolved = 0
    places, values = describer.describe(plan, planner, stager.arena)
    resolved = _Counting.resolved
    want_places, want_values = handoff.describe(plan, planner, stager.arena)
    assert places == want_places and values == want_values  # raw bytes and pickled values: comparable
    _Counting.resolved = resolved
    return plan


def test_a_steady_save_resolves_only_the_items_sent_by_value() -> None:
    """handoff.Describer: the places of the last plan and segment, reused while both are the same; any
    change of plan (a reorder, a new key) or of segment (new buffers) describes every item again, and what
    it returns is always what describe() of every item returns."""
    live = _adam_like(50)
    stager, record, describer = Stager(shared=True), PlanRecord(), handoff.Describer()
    try:
        first = _check(describer, live, stager, record)
        by_value = sum(1 for item in first.items if item.type == WriteItemType.BYTE_IO)
        assert describer.full == 1 and _Counting.resolved == len(first.items)
        segment = stager.arena.id  # type: ignore[union-attr]
        for _ in range(3):  # steady: new values, the same plan object and segment
            with torch.no_grad():
                for t in live["model"].values():
                    t.add_(1.0)
            live["optim"]["param_groups"][0]["lr"] *= 0.5
            plan = _check(describer, live, stager, record)
            assert plan is first and describer.full == 1
            assert _Counting.resolved == by_value == 2  # the byte items only (lr and the params list)
        # A tensor replaced by one of its shape and dtype: the same buffer, plan and segment.
        live["model"]["p3"] = torch.randn(4, 4)
        assert _check(describer, live, stager, record) is first and describer.full == 1
        # The keys in another order: the buffers follow their keys (same segment), DCP plans anew.
        live["model"] = dict(reversed(live["model"].items()))
        plan = _check(describer, live, stager, record)
        assert stager.arena.id == segment  # type: ignore[union-attr]
        assert plan is not first and describer.full == 2
        # A new parameter: new buffers in a new segment, described in full.
        live["model"]["new"] = torch.randn(2, 2)
        _check(describer, live, stager, record)
        assert stager.arena.id != segment and describer.full == 3  # type: ignore[union-attr]
    finally:
        stager.release()


def test_positions_and_checked_answers() -> None:
    sd = _adam_like(3)
    stager, describer = Stager(shared=True), handoff.Describer()
    try:
        plan, planner = _planned(stager.stage(sd), PlanRecord())
        describer.describe(plan, planner, stager.arena)
        items = list(reversed(plan.items))
        want = [len(plan.items) - 1 - i for i in range(len(plan.items))]
        assert describer.positions(plan, items) == want  # by identity
        equal = [dataclasses.replace(item) for item in items]  # equal items, other objects: by index
        assert describer.positions(plan, equal) == want
        results: list[Any] = []
        files = [("__0_0.distcp", [0, 1])]
        assert not describer.checked_before(plan, files, results)
        describer.check_passed(plan, files, results)
        assert describer.checked_before(plan, [("__0_0.distcp", [0, 1])], results)
        assert not describer.checked_before(plan, [("__0_0.distcp", [0])], results)
        assert not describer.checked_before(plan, files, list(results))  # another answer: checked anew
    finally:
        stager.release()
