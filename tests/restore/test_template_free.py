"""Restores without a template (issue 25): what the checkpoint saved, not what the live object holds, says
what loads. A PlainState comes back as the very dict that was saved (a Lightning ``CheckpointIO`` needs
that); an optimizer restores into a fresh one (empty ``state``) wherever it was put, with or without a
model; ``strict=False`` that would load nothing is an error; a multi-worker DataLoader whose sampler
position is not reported is named at the first save."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import safepoint
from safepoint.data.plain import PlainState, decode, encode


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 3)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _fresh(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.5)  # another lr: the saved one must come back


def _same_optimizer(got: torch.optim.Optimizer, want: torch.optim.Optimizer) -> None:
    g, w = got.state_dict(), want.state_dict()
    assert g["param_groups"] == w["param_groups"]
    assert g["state"].keys() == w["state"].keys() == {0, 1}
    for i in w["state"]:
        for k, v in w["state"][i].items():
            assert torch.equal(g["state"][i][k], v), (i, k)


def test_an_optimizer_restores_into_a_fresh_one_wherever_it_was_put(root: Path) -> None:
    _model, opt = _trained(0)
    with safepoint.CheckpointManager(root) as mgr:  # no model=: an optimizer saves on its own
        mgr.save(5, safepoint.TrainState(optimizer=opt, objects={"o": opt}, extra={"o": opt}, rng=False))
    target = torch.nn.Linear(3, 2)
    fresh = [_fresh(target) for _ in range(3)]
    assert all(not f.state_dict()["state"] for f in fresh)
    state = safepoint.TrainState(
        optimizer=fresh[0], objects={"o": fresh[1]}, extra={"o": fresh[2]}, rng=False
    )
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(state) == 5
    for f in fresh:
        _same_optimizer(f, opt)


def test_a_list_of_optimizers_without_a_model(root: Path) -> None:
    (_, a), (_, b) = _trained(1), _trained(2)
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, safepoint.TrainState(optimizer=[a, b], rng=False))
    fa, fb = _fresh(torch.nn.Linear(3, 2)), _fresh(torch.nn.Linear(3, 2))
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(optimizer=[fa, fb], rng=False)) == 1
    _same_optimizer(fa, a)
    _same_optimizer(fb, b)


def _framework_dict() -> dict[str, object]:
    """What a framework's checkpoint holds: int keys, empty dicts, tuples with tensors, nested lists."""
    _, opt = _trained(3)
    return {
        "epoch": 2,
        "optimizer_states": [opt.state_dict()],
        "loops": {"fit_loop": {"state_dict": {}, "progress": {"total": {"ready": 7}}}},
        "pair": (torch.arange(3), "x"),
        "by_id": {0: torch.ones(2), 7: "seven"},
        "names": ["a", "b"],
        "nothing": None,
    }


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return type(a) is type(b) and a == b


def test_encode_decode_is_exact() -> None:
    d = _framework_dict()
    assert _equal(decode(encode(d)), d)


def test_a_plain_state_restores_the_saved_dict_into_an_empty_one(root: Path) -> None:
    saved = _framework_dict()
    per_rank = {"rng": torch.get_rng_state(), "position": {0: 12}}
    with safepoint.CheckpointManager(root) as mgr:
        state = safepoint.TrainState(objects={"fw": PlainState(saved)}, extra={"r": PlainState(per_rank)})
        mgr.save(3, state)
    fw, r = PlainState(), PlainState({"stale": 1})  # nothing in it, or something else: the saved dict wins
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(objects={"fw": fw}, extra={"r": r})) == 3
    assert _equal(fw.value, saved)
    assert _equal(r.value, per_rank)


def test_a_plain_state_load_is_verified_and_falls_back(root: Path) -> None:
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, safepoint.TrainState(objects={"fw": PlainState({"w": torch.zeros(64)})}, rng=False))
        mgr.save(2, safepoint.TrainState(objects={"fw": PlainState({"w": torch.ones(64)})}, rng=False))
    data = max((root / "step-2").glob("*.distcp"), key=lambda p: p.stat().st_size)
    flip_byte(data)
    fw = PlainState()
    with safepoint.CheckpointManager(root) as mgr:
        with pytest.warns(safepoint.CheckpointWarning, match="step 2|step-2"):
            assert mgr.restore(safepoint.TrainState(objects={"fw": fw}, rng=False)) == 1
    assert torch.equal(fw.value["w"], torch.zeros(64))


def test_a_plain_state_refuses_what_weights_only_would_refuse(root: Path) -> None:
    with safepoint.CheckpointManager(root) as mgr:
        with pytest.raises(safepoint.SaveError, match="not plain data"):
            mgr.save(1, safepoint.TrainState(objects={"fw": PlainState({"f": object()})}, rng=False))


def test_strict_false_that_loads_nothing_is_an_error(root: Path) -> None:
    model, opt = _trained(0)
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(4, safepoint.TrainState(model=model, optimizer=opt, rng=False))
    other = torch.nn.Sequential(torch.nn.Conv1d(1, 1, 1))  # not one key in common
    with safepoint.CheckpointManager(root) as mgr:
        with pytest.raises(safepoint.StateMismatchError, match=r"strict=False\) matched no key"):
            mgr.restore(safepoint.TrainState(model=other, rng=False), strict=False)
        # One matching key is a partial restore, as before.
        assert mgr.restore(safepoint.TrainState(model=torch.nn.Linear(3, 2), rng=False), strict=False) == 4


class _Squares(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])


def _one_batch_then_save(root: Path, workers: int, advance: bool) -> None:
    sampler = safepoint.ResumableSampler(64, seed=1)
    loader = DataLoader(_Squares(), batch_size=4, sampler=sampler, num_workers=workers)
    with safepoint.CheckpointManager(root) as mgr:
        for batch in loader:
            if advance:
                sampler.advance(len(batch))
            mgr.save(1, safepoint.TrainState(dataloader=sampler, rng=False))
            break


def test_a_multi_worker_loader_without_advance_is_named_at_the_first_save(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"num_workers=2 .*sampler\.advance"):
        _one_batch_then_save(tmp_path / "a", workers=2, advance=False)
    assert not list((tmp_path / "a").glob("step-*"))
    _one_batch_then_save(tmp_path / "b", workers=2, advance=True)  # reported: exact, saves
    _one_batch_then_save(tmp_path / "c", workers=0, advance=False)  # no workers: the iterator's count
    assert [p.name for p in (tmp_path / "b").glob("step-*")] == ["step-1"]
