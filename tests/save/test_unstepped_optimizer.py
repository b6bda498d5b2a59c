"""A save before the optimizer's first step changes nothing (found in round 5's review of the no-state
restore): DCP's get_state_dict gives an optimizer with no state one by stepping it with zero gradients and a
zero learning rate, so the live optimizer went on from step 1, not 0 (Adam's bias correction differs), and
the checkpoint held that made-up state. A save now captures such an optimizer as it is, without state, and
leaves it so; a resume from that checkpoint gives a fresh optimizer no state either."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import safepoint


def _make() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    first = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    second = torch.optim.Adam(model[2].parameters(), lr=1e-2)
    return model, first, second


def _steps(model: nn.Module, optims: list[torch.optim.Optimizer], n: int, which: int = 2) -> None:
    for i in range(n):
        for o in optims:
            o.zero_grad()
        model(torch.full((3, 4), 0.5 + i)).pow(2).sum().backward()
        for o in optims[:which]:
            o.step()


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_before_the_first_step_changes_nothing(tmp_path: Path, async_save: bool) -> None:
    model, first, second = _make()
    _steps(model, [first, second], 3)
    reference = _weights(model)

    model, first, second = _make()
    writer = safepoint.WriterOptions(async_writer="thread")
    with safepoint.CheckpointManager(tmp_path / "ckpt", async_save=async_save, writer=writer) as mgr:
        mgr.save(0, safepoint.TrainState(model=model, optimizer=[first, second], rng=False))
        mgr.wait()
        assert len(first.state) == 0 and len(second.state) == 0  # left as it was: not stepped
        _steps(model, [first, second], 3)
    assert _equal(_weights(model), reference)


def test_a_resume_from_before_the_first_step_goes_on_as_the_run_did(tmp_path: Path) -> None:
    model, first, second = _make()
    _steps(model, [first, second], 3)
    reference = _weights(model)

    model, first, second = _make()
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(0, safepoint.TrainState(model=model, optimizer=[first, second], rng=False))
    model, first, second = _make()
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.restore(safepoint.TrainState(model=model, optimizer=[first, second], rng=False)) == 0
    assert len(first.state) == 0 and len(second.state) == 0
    _steps(model, [first, second], 3)
    assert _equal(_weights(model), reference)


def test_one_optimizer_stepped_and_one_not(tmp_path: Path) -> None:
    # The first optimizer has stepped, the second never has (its layer is frozen for a warm-up, say): the
    # checkpoint holds the first's state exactly and none for the second, live and restored alike.
    model, first, second = _make()
    _steps(model, [first, second], 2, which=1)
    saved_state = {k: {n: t.clone() for n, t in v.items()} for k, v in first.state_dict()["state"].items()}
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(2, safepoint.TrainState(model=model, optimizer=[first, second], rng=False))
    assert len(second.state) == 0 and len(first.state) == 2
    _steps(model, [first, second], 2)
    reference = _weights(model)

    fresh_model, f1, f2 = _make()
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.restore(safepoint.TrainState(model=fresh_model, optimizer=[f1, f2], rng=False)) == 2
    assert len(f2.state) == 0
    restored = f1.state_dict()["state"]
    assert restored.keys() == saved_state.keys()
    for k, v in saved_state.items():
        assert all(torch.equal(torch.as_tensor(v[n]), torch.as_tensor(restored[k][n])) for n in v)
    _steps(fresh_model, [f1, f2], 2)
    assert _equal(_weights(fresh_model), reference)
