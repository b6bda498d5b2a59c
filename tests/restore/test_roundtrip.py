"""Exact round trip: restore, continue, and match an uninterrupted run bit for bit."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import safepoint
from tests.helpers.train import Setup, assert_bitwise_equal, seed_everything


def _uninterrupted(steps: int) -> Setup:
    s = Setup()
    for _ in range(steps):
        s.step()
    return s


def test_resume_is_bitwise_identical(root: Path) -> None:
    ref = _uninterrupted(12)

    s = Setup()
    with safepoint.CheckpointManager(root, save_every_steps=5) as mgr:
        assert mgr.restore(s.state()) == 0
        for step in range(1, 8):
            s.step()
            mgr.maybe_save(step, s.state())
    # A new process would start from scratch: fresh objects, different RNG state.
    seed_everything(1234)
    s2 = Setup(seed=99)
    with safepoint.CheckpointManager(root, save_every_steps=5) as mgr:
        start = mgr.restore(s2.state())
        assert start == 5
        assert s2.extra["tokens_seen"] == 20
        assert s2.sched.last_epoch == 5
        for _ in range(start, 12):
            s2.step()
    assert_bitwise_equal(ref.snapshot(), s2.snapshot())
    assert s2.extra == ref.extra


def test_rng_not_restored_changes_the_run(root: Path) -> None:
    """Guards the test above: without RNG restore the continuation differs (dropout, data)."""
    ref = _uninterrupted(8)
    s = Setup()
    with safepoint.CheckpointManager(root) as mgr:
        for _ in range(4):
            s.step()
        mgr.save(4, s.state(rng=False))
    seed_everything(1234)
    s2 = Setup(seed=99)
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(s2.state(rng=False)) == 4
    for _ in range(4):
        s2.step()
    assert not all(
        torch.equal(a, b) for a, b in zip(ref.snapshot().values(), s2.snapshot().values(), strict=True)
    )


def test_rng_streams_restored_exactly(root: Path) -> None:
    seed_everything(7)
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, safepoint.TrainState())
        expected = (random.random(), float(np.random.rand()), torch.rand(3), float(np.random.randn()))
        random.gauss(0, 1)  # leaves a cached gauss in Python's state
        seed_everything(99)
        assert mgr.restore(safepoint.TrainState()) == 1
        got = (random.random(), float(np.random.rand()), torch.rand(3), float(np.random.randn()))
    assert got[0] == expected[0] and got[1] == expected[1] and got[3] == expected[3]
    assert torch.equal(got[2], expected[2])


def test_list_of_optimizers_and_stateful_extra(root: Path) -> None:
    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> dict[str, int]:
            return {"n": self.n}

        def load_state_dict(self, sd: dict[str, int]) -> None:
            self.n = sd["n"]

    def build() -> tuple[torch.nn.Module, list[torch.optim.Optimizer], Counter]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        opts: list[torch.optim.Optimizer] = [
            torch.optim.SGD(m[0].parameters(), lr=0.1, momentum=0.9),
            torch.optim.Adam(m[1].parameters(), lr=0.01),
        ]
        return m, opts, Counter()

    m, opts, c = build()
    for _ in range(3):
        m(torch.randn(2, 4)).sum().backward()
        for o in opts:
            o.step()
        c.n += 1
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(3, safepoint.TrainState(model=m, optimizer=opts, extra={"c": c, "lr_hist": [0.1, 0.2]}))
    m2, opts2, c2 = build()
    extra: dict[str, object] = {"c": c2, "lr_hist": []}
    with safepoint.CheckpointManager(root) as mgr:
        mgr.restore(safepoint.TrainState(model=m2, optimizer=opts2, extra=extra))
    assert c2.n == 3 and extra["lr_hist"] == [0.1, 0.2]
    for a, b in zip(m.state_dict().values(), m2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(
        opts[0].state_dict()["state"][0]["momentum_buffer"],
        opts2[0].state_dict()["state"][0]["momentum_buffer"],
    )
    assert torch.equal(
        opts[1].state_dict()["state"][0]["exp_avg_sq"], opts2[1].state_dict()["state"][0]["exp_avg_sq"]
    )


def test_plain_dcp_load_reads_our_checkpoint(root: Path) -> None:
    s = Setup()
    s.step()
    with safepoint.CheckpointManager(root) as mgr:
        info = mgr.save(1, s.state())
    target = {"model": {k: torch.zeros_like(v) for k, v in s.model.state_dict().items()}}
    dcp.load(target, checkpoint_id=info.path)
    for k, v in s.model.state_dict().items():
        assert torch.equal(target["model"][k], v)


def test_layout_and_manifest(root: Path) -> None:
    s = Setup()
    with safepoint.CheckpointManager(root) as mgr:
        info = mgr.save(3, s.state(), metrics={"loss": torch.tensor(1.5), "acc": 0.25})
        assert mgr.latest_step() == 3
        [listed] = mgr.list()
    assert listed == info and listed.metrics == {"loss": 1.5, "acc": 0.25}
    step_dir = root / "step-3"
    names = {p.name for p in step_dir.iterdir()}
    assert {".metadata", "safepoint.json", "__0_0.distcp"} <= names
    m = safepoint.store.manifest.Manifest.from_json((step_dir / "safepoint.json").read_bytes())  # type: ignore[attr-defined]
    assert m.step == 3 and m.world_size == 1
    assert m.keys == ["model", "optimizer", "scheduler", "rng", "extra"]
    # rank 0's RNG and extra; its tensors' fingerprints (the next process's first incremental save)
    assert set(m.files) == {".metadata", "__0_0.distcp", "rank-0.state", "rank-0.fingerprints"}
    assert m.versions["torch"] == torch.__version__
    assert sum(f.size for f in m.files.values()) == info.bytes
    assert not any((root / ".pending").iterdir())


def test_saving_existing_step_with_overwrite_replaces_it(root: Path) -> None:
    s = Setup()
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(2, s.state())
        s.step()
        mgr.save(2, s.state(), overwrite=True)
        expected = s.snapshot()
    s2 = Setup(seed=5)
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(s2.state()) == 2
    assert_bitwise_equal(expected, s2.snapshot())
    assert not any((root / ".pending").iterdir())


def test_restore_explicit_step(root: Path) -> None:
    s = Setup()
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, s.state())
        at1 = s.snapshot()
        s.step()
        mgr.save(2, s.state())
        s2 = Setup(seed=3)
        assert mgr.restore(s2.state(), step=1) == 1
        assert_bitwise_equal(at1, s2.snapshot())
        with pytest.raises(
            safepoint.CheckpointError, match=r"no committed checkpoint for step 7.*available: \[1, 2\]"
        ):
            mgr.restore(s2.state(), step=7)


def test_maybe_save_policies(root: Path) -> None:
    s = Setup()
    with safepoint.CheckpointManager(root, save_every_steps=3) as mgr:
        saved = [step for step in range(1, 10) if mgr.maybe_save(step, s.state())]
        assert saved == [3, 6, 9]
        assert mgr.maybe_save(9, s.state()) is False  # same step twice is not saved twice
    with safepoint.CheckpointManager(root / "t", save_every_seconds=3600) as mgr:
        assert mgr.maybe_save(1, s.state()) is False
    with safepoint.CheckpointManager(root / "n") as mgr:
        assert mgr.maybe_save(1, s.state()) is False  # no policy: maybe_save never saves


# ---- tensors are read straight into their destinations, with DCP's path for everything else -----------


def _spy_in_place(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    from safepoint.store import direct_read, reader

    taken: list[bool] = []
    real = direct_read.read_in_place

    def spy(*args: object) -> int | None:
        crc = real(*args)  # type: ignore[arg-type]
        taken.append(crc is not None)  # the item's crc32c when it was read in place, None when not
        return crc

    monkeypatch.setattr(reader, "read_in_place", spy)
    return taken


def test_restore_reads_every_tensor_in_place(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = Setup()
    s.step()
    expected = s.snapshot()
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, s.state())
        taken = _spy_in_place(monkeypatch)
        s2 = Setup(seed=5)
        assert mgr.restore(s2.state()) == 1
    assert_bitwise_equal(expected, s2.snapshot())
    # Every parameter and Adam moment (and the RNG tensors) took the direct read.
    assert len(taken) >= 3 * len(list(s.model.parameters())) and all(taken)


def test_in_place_reads_fall_back_for_other_dtypes_and_layouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safepoint.store.reader import SafeLoadPlanner, SafeReader
    from safepoint.store.storage import SafepointWriter

    src = {
        "a": torch.randn(6, 4),
        "b": torch.randn(5, 3),
        "c": torch.arange(12, dtype=torch.int64),
        "bf": torch.randn(7).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
    }
    dcp.save(src, storage_writer=SafepointWriter(tmp_path), no_dist=True)
    taken = _spy_in_place(monkeypatch)
    dst = {
        "a": torch.zeros(4, 6).t(),  # not contiguous: DCP's path
        "b": torch.zeros(5, 3, dtype=torch.float64),  # another dtype: DCP's path converts
        "c": torch.zeros(12, dtype=torch.int64),
        "bf": torch.zeros(7, dtype=torch.bfloat16),
        "scalar": torch.tensor(0.0),
        "empty": torch.ones(0, 3),
    }
    keep = dst["a"]
    dcp.load(dst, storage_reader=SafeReader(tmp_path), planner=SafeLoadPlanner(), no_dist=True)
    assert dst["a"] is keep and torch.equal(dst["a"], src["a"])
    assert torch.equal(dst["b"], src["b"].double())
    for k in ("c", "bf", "scalar", "empty"):
        assert torch.equal(dst[k], src[k]) and dst[k].dtype == src[k].dtype, k
    # a and b took DCP's path, c, bf and scalar the direct read (DCP plans no read for an empty tensor).
    assert taken.count(False) == 2 and taken.count(True) >= 3
