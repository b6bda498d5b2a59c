"""ResumableSampler: drop-in for DistributedSampler, and exact resumption at any world size."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from safepoint import CheckpointManager, ResumableSampler, TrainState


class _Ids(Dataset[int]):
    """A map-style dataset whose samples are their own indices."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _ranks(n: int, ws: int, **kw: Any) -> list[ResumableSampler]:
    return [ResumableSampler(n, rank=r, world_size=ws, **kw) for r in range(ws)]


def _consume(samplers: list[ResumableSampler], rounds: int, per_step: int) -> list[int]:
    """Iterate every rank in lockstep for ``rounds`` steps of ``per_step`` samples; return what was seen."""
    iters = [iter(s) for s in samplers]
    seen: list[int] = []
    for _ in range(rounds):
        for it in iters:
            seen.extend(itertools.islice(it, per_step))
    return seen


def _shared_state(samplers: list[ResumableSampler]) -> dict[str, Any]:
    states = [s.state_dict() for s in samplers]
    assert all(st == states[0] for st in states), f"ranks disagree on the position: {states}"
    return states[0]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize(("n", "ws"), [(10, 1), (10, 3), (12, 4), (3, 4), (7, 2), (0, 2)])
def test_same_indices_as_distributed_sampler(shuffle: bool, drop_last: bool, n: int, ws: int) -> None:
    for epoch in (0, 3):
        for r in range(ws):
            ref: DistributedSampler[int] = DistributedSampler(
                _Ids(n), num_replicas=ws, rank=r, shuffle=shuffle, seed=5, drop_last=drop_last
            )
            ours = ResumableSampler(n, rank=r, world_size=ws, shuffle=shuffle, seed=5, drop_last=drop_last)
            ref.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert list(ours) == list(ref)
            assert len(ours) == len(ref)


@pytest.mark.parametrize(
    ("n", "plan"),
    [
        # (world size, steps, samples per rank per step) for each segment of one epoch
        (60, [(2, 3, 2), (3, 3, 2), (1, 3, 2), (2, 6, 2)]),
        (48, [(4, 1, 3), (1, 5, 1), (3, 3, 2), (5, 1, 1), (2, 5, 2)]),
        (30, [(3, 2, 1), (2, 12, 1)]),
    ],
)
@pytest.mark.parametrize("shuffle", [True, False])
def test_resume_at_any_world_size_sees_every_sample_once(
    n: int, plan: list[tuple[int, int, int]], shuffle: bool
) -> None:
    seen: list[int] = []
    state: dict[str, Any] | None = None
    for ws, steps, per in plan:
        samplers = _ranks(n, ws, shuffle=shuffle, seed=11)
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)
            s.set_epoch(0)  # the usual loop calls set_epoch(epoch) again after a restore
        seen += _consume(samplers, steps, per)
        state = _shared_state(samplers)
    assert Counter(seen) == Counter(range(n)), "a sample was skipped or seen twice"
    assert state is not None and (state["epoch"], state["position"]) == (0, n)


def test_resume_without_shuffle_continues_in_order() -> None:
    a = _ranks(20, 2, shuffle=False)
    assert _consume(a, 3, 1) == [0, 1, 2, 3, 4, 5]
    b = _ranks(20, 3, shuffle=False)
    for s in b:
        s.load_state_dict(_shared_state(a))
    assert [list(s) for s in b] == [[6, 9, 12, 15, 18], [7, 10, 13, 16, 19], [8, 11, 14, 17, 6]]


def test_tail_is_padded_or_dropped_like_distributed_sampler() -> None:
    a = _ranks(10, 2, shuffle=False)
    _consume(a, 3, 1)  # position 6: samples 6..9 remain
    cases = [
        (2, False, [[6, 8], [7, 9]]),
        (3, False, [[6, 9], [7, 6], [8, 7]]),  # padded with repeats from the start of the rest
        (3, True, [[6], [7], [8]]),  # 9 is dropped
    ]
    for ws, drop_last, expected in cases:
        b = _ranks(10, ws, shuffle=False, drop_last=drop_last)
        for s in b:
            s.load_state_dict({**_shared_state(a), "drop_last": drop_last})
        assert [list(s) for s in b] == expected
        assert all(s.position == 10 for s in b)


def test_restored_position_is_used_once_and_set_epoch_semantics() -> None:
    a = ResumableSampler(8, shuffle=False)
    it = iter(a)
    assert [next(it), next(it), next(it)] == [0, 1, 2]
    st = a.state_dict()
    assert st["position"] == 3
    b = ResumableSampler(8, shuffle=False)
    b.load_state_dict(st)
    assert len(b) == 5
    b.set_epoch(0)  # same epoch: the restored position stays
    assert list(b) == [3, 4, 5, 6, 7]
    assert b.position == 8
    assert list(b) == list(range(8))  # a later iteration of the epoch starts over, as DistributedSampler
    c = ResumableSampler(8, shuffle=False)
    c.load_state_dict(st)
    c.set_epoch(1)  # another epoch: its beginning
    assert c.position == 0 and list(c) == list(range(8))


def test_finished_epoch_resumes_empty_then_next_epoch() -> None:
    a = ResumableSampler(6, seed=3)
    first = list(a)
    st = a.state_dict()
    assert st["position"] == 6
    b = ResumableSampler(6, seed=3)
    b.load_state_dict(st)
    assert list(b) == []
    b.set_epoch(1)
    second = list(b)
    assert sorted(second) == sorted(first) and second != first  # a new shuffle for the new epoch


def test_dataloader_without_workers_counts_yielded_batches() -> None:
    s = ResumableSampler(40, seed=1, rank=1, world_size=2)
    loader = DataLoader(_Ids(40), batch_size=4, sampler=s)
    batches = []
    for batch in loader:
        batches.append(batch.tolist())
        if len(batches) == 3:
            break
    assert s.state_dict()["position"] == 3 * 4 * 2
    t = ResumableSampler(40, seed=1, rank=1, world_size=2)
    t.load_state_dict(s.state_dict())
    rest = [b.tolist() for b in DataLoader(_Ids(40), batch_size=4, sampler=t)]
    assert list(itertools.chain(*batches, *rest)) == list(ResumableSampler(40, seed=1, rank=1, world_size=2))


def test_multiworker_dataloader_needs_advance() -> None:
    """Workers prefetch: the iterator's count runs ahead; advance() reports what training consumed."""
    s = ResumableSampler(64, seed=2)
    loader = DataLoader(_Ids(64), batch_size=4, sampler=s, num_workers=2, prefetch_factor=2)
    trained: list[int] = []
    for batch in loader:
        trained += batch.tolist()
        s.advance(len(batch))
        if len(trained) == 12:
            break
    assert s._yielded > 12  # the workers drew more than was trained on
    assert s.state_dict()["position"] == 12
    t = ResumableSampler(64, seed=2)
    t.load_state_dict(s.state_dict())
    rest: list[int] = []
    for batch in DataLoader(_Ids(64), batch_size=4, sampler=t, num_workers=2):
        rest += batch.tolist()
        t.advance(len(batch))
    assert Counter(trained + rest) == Counter(range(64))
    assert t.position == 64


def test_advance_rejects_more_than_drawn() -> None:
    s = ResumableSampler(16)
    with pytest.raises(ValueError, match="before iterating"):
        s.advance(1)
    it = iter(s)
    next(it)
    with pytest.raises(ValueError, match="per-rank batch size"):
        s.advance(2)


def test_load_refuses_a_different_permutation() -> None:
    st = ResumableSampler(10, seed=1).state_dict()
    for other in (ResumableSampler(10, seed=2), ResumableSampler(10, seed=1, shuffle=False)):
        with pytest.raises(ValueError, match="cannot be applied"):
            other.load_state_dict(st)
    with pytest.raises(ValueError, match="dataset_size"):
        ResumableSampler(11, seed=1).load_state_dict(st)


def test_argument_validation_and_defaults() -> None:
    s = ResumableSampler(5)
    assert (s.rank, s.world_size) == (0, 1)
    for kw in ({"rank": 2, "world_size": 2}, {"world_size": 0}, {"rank": -1}):
        with pytest.raises(ValueError):
            ResumableSampler(5, **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ResumableSampler(-1)
    with pytest.raises(ValueError):
        s.set_epoch(-1)
    TrainState(dataloader=s)  # it is Stateful


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_stateful_dataloader_resumes_at_another_world_size() -> None:
    """torchdata's StatefulDataLoader snapshots the sampler per batch, so prefetching does not matter."""
    sdl_mod = pytest.importorskip("torchdata.stateful_dataloader")
    n, bs = 48, 2

    def loaders(ws: int, state: dict[str, Any] | None) -> list[Any]:
        out = []
        for r in range(ws):
            s = ResumableSampler(n, seed=4, rank=r, world_size=ws)
            dl = sdl_mod.StatefulDataLoader(_Ids(n), batch_size=bs, sampler=s, num_workers=2)
            if state is not None:
                dl.load_state_dict(state)
            out.append(dl)
        return out

    seen: list[int] = []
    first = loaders(2, None)
    iters = [iter(dl) for dl in first]
    for _ in range(6):  # 24 of 48 consumed: the rest divides among 3 ranks without padding
        for it in iters:
            seen += next(it).tolist()
    state = first[0].state_dict()
    second = loaders(3, state)
    for dl in second:
        for batch in dl:
            seen += batch.tolist()
    assert Counter(seen) == Counter(range(n))


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_stateful_dataloader_as_train_state_dataloader(tmp_path: Path) -> None:
    """The loader itself (holding the sampler) saved and restored through a CheckpointManager."""
    sdl_mod = pytest.importorskip("torchdata.stateful_dataloader")

    def loader() -> Any:
        s = ResumableSampler(40, seed=3)
        return sdl_mod.StatefulDataLoader(_Ids(40), batch_size=4, sampler=s, num_workers=2)

    first = loader()
    it = iter(first)
    seen = [i for _ in range(3) for i in next(it).tolist()]
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(3, TrainState(dataloader=first, rng=False))
    second = loader()
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.restore(TrainState(dataloader=second, rng=False)) == 3
    seen += [i for batch in second for i in batch.tolist()]
    assert Counter(seen) == Counter(range(40))


def test_position_is_global_not_per_rank() -> None:
    samplers = _ranks(100, 4, seed=9)
    _consume(samplers, 5, 3)
    assert _shared_state(samplers)["position"] == 5 * 3 * 4
