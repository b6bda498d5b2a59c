"""rev5 review of data/fqn_cache.py's identity (the ids of each module's ``_parameters``): modules swapped
so that the parameters, their order and the state-dict keys all stay the same while the name torch gives a
parameter changes (which of two places sharing a module it is reached by first)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from safepoint.data import fqn_cache


class _Three(nn.Module):
    def __init__(self, a: nn.Module, b: nn.Module, c: nn.Module) -> None:
        super().__init__()
        self.a, self.b, self.c = a, b, c


def _step(model: _Three, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(2, 4)
    (model.a(x).sum() + model.b(x).sum() + model.c(x).sum()).backward()
    opt.step()
    opt.zero_grad()


def test_a_shared_module_moved_to_another_place_gets_torchs_names() -> None:
    one, two = nn.Linear(4, 4), nn.Linear(4, 4)
    model = _Three(one, one, two)  # "one" shared by a and b: its names a.*, two's c.*
    opt = torch.optim.Adam(model.parameters())
    _step(model, opt)
    assert fqn_cache._same(fqn_cache.state_dicts(model, [opt]), get_state_dict(model, [opt]))
    model.b = two  # now "two" is shared by b and c: torch names it b.*; same ids in order, same keys
    _step(model, opt)
    got, want = fqn_cache.state_dicts(model, [opt]), get_state_dict(model, [opt])
    assert sorted(got[1]["state"]) == sorted(want[1]["state"])
    assert fqn_cache._same(got, want)


def test_a_nested_shared_module_moved_and_a_child_set_to_none_get_torchs_names() -> None:
    shared = nn.Linear(4, 4)
    model = nn.Sequential(nn.Sequential(shared, nn.ReLU()), nn.Sequential(nn.Linear(4, 4), shared))
    opt = torch.optim.Adam(model.parameters())

    def step() -> None:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    assert fqn_cache._same(fqn_cache.state_dicts(model, [opt]), get_state_dict(model, [opt]))
    # The shared Linear reached first through the second branch now: torch names it 1.1.*, not 0.0.*.
    model[0], model[1] = model[1], model[0]
    step()
    assert fqn_cache._same(fqn_cache.state_dicts(model, [opt]), get_state_dict(model, [opt]))
    model[0][1] = nn.Identity()  # the same parameters, one fewer path to the shared one
    step()
    assert fqn_cache._same(fqn_cache.state_dicts(model, [opt]), get_state_dict(model, [opt]))
