"""A plain optimizer is restored without torch's quadratic ``_split_optim_state_dict`` (safepoint/data/optim_load.py),
to exactly the state ``set_state_dict`` gives; anything else goes through ``set_state_dict`` as before."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as dsd
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import safepoint
from safepoint.data.optim_load import in_order


def _trained(
    tied: bool = False, frozen: bool = False, groups: int = 1
) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    if tied:
        model[2].weight = nn.Parameter(model[0].weight.t().contiguous())
        model.add_module("tied", model[0])  # the same parameters under a second name
    if frozen:
        model[0].bias.requires_grad_(False)
    params = list(model.parameters())
    if groups == 2:
        opt: torch.optim.Optimizer = torch.optim.AdamW(
            [{"params": params[:2], "lr": 1e-2}, {"params": params[2:], "weight_decay": 0.5}]
        )
    else:
        opt = torch.optim.AdamW(params, lr=1e-3)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _same(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for k, v in sa["state"].items():
        for name, t in v.items():
            assert torch.equal(t, sb["state"][k][name]), (k, name)


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("groups", [1, 2])
def test_the_ordered_load_gives_what_set_state_dict_gives(frozen: bool, groups: int) -> None:
    source_model, source = _trained(frozen=frozen, groups=groups)
    _, saved = get_state_dict(source_model, [source])
    saved = copy.deepcopy(saved)
    results = []
    for use_ordered in (True, False):
        model, opt = _trained(frozen=frozen, groups=groups)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()  # a different state, to be overwritten
        loaded = copy.deepcopy(saved)
        if use_ordered:
            load = in_order(model, [opt], loaded)
            assert load is not None
            load()
        else:
            set_state_dict(model, [opt], model_state_dict={}, optim_state_dict=loaded)
        results.append(opt)
    _same(results[0], results[1])
    _same(results[0], source)


def test_what_it_cannot_prove_goes_through_set_state_dict() -> None:
    model, opt = _trained(tied=True)
    _, saved = get_state_dict(model, [opt])
    assert in_order(model, [opt], saved) is None  # a parameter under two names
    model, opt = _trained()
    _, saved = get_state_dict(model, [opt])
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    assert in_order(model, [opt, other], saved) is None  # several optimizers share the loaded state
    renamed = copy.deepcopy(saved)
    renamed["param_groups"][0]["params"] = list(reversed(renamed["param_groups"][0]["params"]))
    assert in_order(model, [opt], renamed) is None  # the groups list other parameters, or another order
    # A parameter the groups name without a state: loaded without one (the saved optimizer had none for
    # it; restore/stateless.py decides that from the checkpoint), as set_state_dict(strict=False) does.
    missing = copy.deepcopy(saved)
    del missing["state"]["0.weight"]
    load = in_order(model, [opt], missing)
    assert load is not None
    load()
    assert model[0].weight not in opt.state and model[0].bias in opt.state


def test_a_restore_never_calls_torchs_split(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _trained(groups=2)
    state = safepoint.TrainState(model=model, optimizer=opt, rng=False)
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, state)
    expected = copy.deepcopy(opt.state_dict())

    def quadratic(*args: object, **kwargs: object) -> None:
        raise AssertionError("_split_optim_state_dict called")

    monkeypatch.setattr(dsd, "_split_optim_state_dict", quadratic)
    model2, opt2 = _trained(groups=2)
    opt2.step()
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(model=model2, optimizer=opt2, rng=False)) == 1
    got = opt2.state_dict()
    assert got["param_groups"] == expected["param_groups"]
    for k, v in expected["state"].items():
        for name, t in v.items():
            assert torch.equal(got["state"][k][name], t)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
