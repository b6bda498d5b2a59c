"""An async save restores what a sync save of the same state restores, inside a pickled value too.

DCP stores a tuple (and a list holding no tensor and no dict, such as a list of tuples) as one pickled
value: ``torch.save`` keeps the objects in it that are one object (a weight tied twice stays one tensor),
and a view keeps its strides, its storage offset and the whole storage it views, shared with every other
view of it in that value. The async snapshot copied each tensor on its own, contiguous: the same state came
back as separate, contiguous copies. These tests pin what the sync save restores and ask the same of both
async writers, on the first save and on one that reuses the staging buffers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from safepoint.errors import SaveError
from safepoint.save.staging import Stager
from tests.helpers.fidelity import canon, save_and_restore

MODES = ["thread", "process"]


def _tied() -> dict[str, Any]:
    w = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    y = torch.arange(5.0)
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    return {"param": (w, w), "plain": (y, y, [y], {"y": y}), "frozen": ((frozen,), [frozen])}


def _views() -> dict[str, Any]:
    x = torch.arange(12.0).reshape(3, 4)
    big = torch.arange(20.0).reshape(4, 5)
    rows = torch.arange(20.0).reshape(4, 5)
    p = torch.nn.Parameter(torch.arange(4.0).reshape(2, 2))
    z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    return {
        "t": (x.t(),),
        "strided": (big[:, ::2], big[1:, 1:3], big),
        "two_rows": (rows[0], rows[2]),  # rows 1 and 3 are in no view: still in the storage sync saves
        "param_view": (p, p.t()),
        "conj": (z, z.conj()),
        "empty": (torch.empty(0), torch.empty(0, 3), torch.arange(4.0)[2:2]),
    }


def _in_a_list() -> dict[str, Any]:
    # A list with no tensor and no dict of its own is one pickled value too: the tuples in it share.
    y = torch.arange(3.0)
    inner = [1, 2]
    return {"l": [(y,), (y[1:],), [inner, inner]], "apart": [y, (y,)]}


def _template(value: Any) -> Any:
    """A state of the same keys for the restore to fill: tensors outside pickled values zeroed in place
    of their values (DCP loads those into the template's own tensors)."""
    if isinstance(value, dict):
        return {k: _template(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_template(v) for v in value]
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    return ()


@pytest.mark.parametrize("mode", MODES)
def test_async_restores_what_sync_restores(tmp_path: Path, mode: str) -> None:
    state = {**_tied(), **_views(), **_in_a_list()}
    want = save_and_restore(state, _template(state), "sync", tmp_path / "sync")
    got = save_and_restore(state, _template(state), mode, tmp_path / mode)
    assert canon(got) == canon(want)


def test_what_the_sync_save_restores(tmp_path: Path) -> None:
    # The facts the test above holds an async save to, spelled out.
    state = {**_tied(), **_views()}
    back = save_and_restore(state, _template(state), "sync", tmp_path / "sync")
    w1, w2 = back["param"]
    assert w1 is w2 and type(w1) is torch.nn.Parameter and w1.requires_grad
    a, b, (c,), d = back["plain"]
    assert a is b is c is d["y"]
    (t,) = back["t"]
    assert t.stride() == (1, 4) and t.untyped_storage().nbytes() == 48
    r0, r2 = back["two_rows"]
    assert r2.storage_offset() == 10 and r0.untyped_storage().data_ptr() == r2.untyped_storage().data_ptr()
    assert r0.untyped_storage().nbytes() == 80  # the whole storage of the 4 x 5 tensor
    p, pt = back["param_view"]
    assert type(p) is torch.nn.Parameter and type(pt) is torch.Tensor and pt.requires_grad
    assert pt.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() and pt.stride() == (1, 2)
    z, zc = back["conj"]
    assert zc.is_conj() and not z.is_conj() and torch.equal(zc.resolve_conj(), z.conj().resolve_conj())


@pytest.mark.parametrize(
    ("mode", "gathered"),
    [("thread", False), ("thread", True), ("process", True)],
    ids=["thread", "thread-gathered", "process-gathered"],
)
def test_a_save_that_reuses_the_buffers_restores_the_new_values(
    tmp_path: Path, mode: str, gathered: bool, request: pytest.FixtureRequest
) -> None:
    # The second save reuses the first one's staging buffers (the state kept its structure): the views
    # are rebuilt over them with the new geometry, and the new values are what is restored.
    import safepoint
    from tests.helpers.holder import Holder

    if gathered:
        request.getfixturevalue("gather_on_cpu")
    big = torch.arange(20.0).reshape(4, 5)
    holder = Holder({"t": (big[:, ::2], big[1:, 1:3], big), "w": torch.ones(3)})
    writer = safepoint.WriterOptions(async_writer=mode)
    state = safepoint.TrainState(objects={"o": holder}, rng=False)
    with safepoint.CheckpointManager(tmp_path / "a", async_save=True, writer=writer) as mgr:
        if mode == "process":
            process = mgr._process
            assert process is not None
            process.wait_ready()  # the process writes both saves
        mgr.save(1, state)
        mgr.wait()
        big.mul_(-1)
        holder.v["t"] = (big[1:, ::2], big.t(), big)  # other views of the same storage
        mgr.save(2, state)
        mgr.wait()
        assert mgr._stager.allocations == 1
        assert mgr._stager.gathered == (2 if gathered else 0)  # the storage's bytes and "w"
    want = save_and_restore(holder.v, {"t": (), "w": torch.zeros(3)}, "sync", tmp_path / "sync")
    back = Holder({"t": (), "w": torch.zeros(3)})
    with safepoint.CheckpointManager(tmp_path / "a") as mgr:
        assert mgr.restore(safepoint.TrainState(objects={"o": back}, rng=False)) == 2
    assert canon(back.v) == canon(want)


def test_one_buffer_per_storage_and_kept_across_saves(stager: Stager) -> None:
    big = torch.arange(20.0).reshape(4, 5)
    w = torch.nn.Parameter(torch.ones(3))
    snap = stager.stage({"t": (big[0], big[2], w, w)})
    r0, r2, w1, w2 = snap["t"]
    assert r0.untyped_storage().data_ptr() == r2.untyped_storage().data_ptr() != big.data_ptr()
    assert r2.storage_offset() == 10 and w1 is w2 and type(w1) is torch.nn.Parameter
    big.add_(1)
    snap = stager.stage({"t": (big[1], big.t(), w, w)})
    r1, t, w1, w2 = snap["t"]
    assert stager.allocations == 1  # the same storages: the same buffers
    assert torch.equal(r1, big[1]) and torch.equal(t, big.t()) and t.stride() == (1, 5)
    assert r1.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() and w1 is w2


def test_a_storage_that_grew_gets_new_buffers_not_a_resized_old_one(stager: Stager) -> None:
    # The walk builds each view over the slot the last plan holds at its place before it knows whether
    # that plan still fits: a slot of fewer bytes than the storage now has must not be built on (the
    # process writer's segment cannot grow: the save failed; a private buffer was silently resized).
    small = torch.arange(6.0).reshape(2, 3)
    first = stager.stage({"t": (small.t(), small)})
    old = first["t"][1].untyped_storage()
    was = (old.data_ptr(), old.nbytes())
    big = torch.arange(20.0).reshape(4, 5)
    snap = stager.stage({"t": (big.t(), big)})
    assert stager.allocations == 2
    assert torch.equal(snap["t"][0], big.t()) and snap["t"][0].stride() == (1, 5)
    assert (old.data_ptr(), old.nbytes()) == was


@pytest.mark.parametrize("mode", ["sync", "thread"])  # the value is pickled in the rank with either writer
def test_one_storage_seen_as_two_dtypes_is_refused_by_both_modes(tmp_path: Path, mode: str) -> None:
    # torch.save refuses two views of one storage as different dtypes in one pickle, so a sync save of it
    # fails; the async save, now staging that storage once, fails too (in its writer, raised by wait()),
    # where it used to commit a checkpoint the sync save of the same state refuses.
    x = torch.ones(4)
    with pytest.raises(SaveError, match="view the same data as different types"):
        save_and_restore({"t": (x, x.view(torch.int32))}, {"t": ()}, mode, tmp_path / mode)


def test_keys_reordered_inside_a_tuple_still_snapshot_the_value(stager: Stager) -> None:
    # A dict inside a tuple whose keys come in another order moves which view meets a storage first: the
    # plan re-paired by key (Plan.rekeyed) must not build a view over another storage's buffer.
    a, b = torch.arange(20.0).reshape(4, 5), torch.arange(6.0, dtype=torch.float64)
    first = {"x": a.t(), "y": b[1:], "z": a[1]}
    value = ({"x": a.t(), "y": b[1:], "z": a[1]}, b)
    assert canon(stager.stage({"t": value, "w": torch.ones(2)})["t"]) == canon(value)
    again = ({"z": a[2], "y": b[::2], "x": first["x"]}, b)
    assert canon(stager.stage({"t": again, "w": torch.ones(2)})["t"]) == canon(again)


def test_a_large_storage_in_a_tuple_is_skipped_unchanged_and_copied_unhashed_once_written() -> None:
    # The leaf of a storage is a view of the live tensor, so its version counter is the tensor's: the
    # incremental check skips it while its fingerprint proves it unchanged, and copies it without a
    # fingerprint once it has been written to, as it does a tensor in a dict.
    big = torch.zeros(64, 128)  # 32 KiB: over FINGERPRINT_CPU_MIN_BYTES
    stager = Stager()
    try:
        for _ in range(3):
            stager.stage({"t": (big.t(), big[0])})
        assert stager.skipped == big.numel() * 4
        for _ in range(2):  # the first write after a skip is fingerprinted anyway (save/staging.py)
            big.add_(1)
            snap = stager.stage({"t": (big.t(), big[0])})
        assert stager.skipped == 0 and list(stager.fingerprints.values()) == [None]
        assert torch.equal(snap["t"][0], big.t()) and snap["t"][1].untyped_storage().nbytes() == 32768
    finally:
        stager.release()


def test_a_dtensor_inside_a_tuple_is_staged_once_per_object(stager: Stager, one_rank_group: None) -> None:
    # A DTensor inside a pickled value keeps its own buffer (a DTensor over a host copy of its local
    # tensor), met twice it is one object, and the plain tensors beside it are staged per storage.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    dt = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)])
    x = torch.arange(6.0).reshape(2, 3)
    for step in range(3):
        with torch.no_grad():
            dt.to_local().add_(step)
        snap = stager.stage({"t": (dt, dt, x.t(), x)})
        a, b, xt, xx = snap["t"]
        assert isinstance(a, DTensor) and a is b and torch.equal(a.to_local(), dt.to_local())
        assert a.to_local().data_ptr() != dt.to_local().data_ptr()
        assert xt.untyped_storage().data_ptr() == xx.untyped_storage().data_ptr() and xt.stride() == (1, 3)
    assert stager.allocations == 1
