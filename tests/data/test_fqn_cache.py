"""A plain module's state dicts come from names learned once (data/fqn_cache.py), always exactly what
torch's ``get_state_dict`` gives, which is asked again whenever what the names were learned from changes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from safepoint.data import fqn_cache


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times torch's get_state_dict was called through fqn_cache."""
    calls: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return get_state_dict(*args, **kwargs)

    monkeypatch.setattr(fqn_cache, "get_state_dict", counting)
    return calls


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: two keys, one parameter
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("scratch", torch.ones(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _step(model: nn.Module, opts: list[torch.optim.Optimizer]) -> None:
    x = torch.randint(0, 10, (3,)) if isinstance(model, Tied) else torch.randn(3, 4)
    model(x).sum().backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()


Case = Callable[[], tuple[nn.Module, list[torch.optim.Optimizer]]]


def _adamw() -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    m = _mlp()
    return m, [torch.optim.AdamW(m.parameters(), lr=1e-3)]


def _groups() -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    m = _mlp()
    return m, [torch.optim.SGD([{"params": m[2].parameters(), "lr": 0.5}, {"params": m[0].parameters()}],
                               lr=0.1, momentum=0.9)]  # fmt: skip


def _two() -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    m = _mlp()
    return m, [torch.optim.Adam(m[0].parameters()), torch.optim.SGD(m[2].parameters(), lr=0.1, momentum=0.5)]


def _tied() -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    m = Tied()
    return m, [torch.optim.Adam(m.parameters())]


def _none() -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    return _mlp(), []


def _no_bias() -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    m = nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(), nn.Linear(8, 2))  # a parameter set to None
    return m, [torch.optim.AdamW(m.parameters(), lr=1e-3)]


@pytest.mark.parametrize("make", [_adamw, _groups, _two, _tied, _none, _no_bias])
def test_the_same_answer_as_torch_and_torch_asked_once(make: Case, asked: list[int]) -> None:
    model, opts = make()
    _step(model, opts)
    for _ in range(3):
        got = fqn_cache.state_dicts(model, opts)
        assert fqn_cache._same(got, get_state_dict(model, opts))
        _step(model, opts)
    assert len(asked) == 1  # then learned: the names, not torch's walk


def test_an_optimizer_without_state_is_initialised_by_torch_every_time(asked: list[int]) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: never any state
    for _ in range(2):
        got = fqn_cache.state_dicts(model, [opt])
        assert fqn_cache._same(got, get_state_dict(model, [opt]))
    assert len(asked) == 2


def test_a_changed_model_or_optimizer_asks_torch_again(asked: list[int]) -> None:
    model, (opt,) = _adamw()
    _step(model, [opt])
    fqn_cache.state_dicts(model, [opt])
    fqn_cache.state_dicts(model, [opt])
    assert len(asked) == 1
    extra = nn.Linear(2, 2)
    model.append(extra)  # a new module: new keys, new parameters
    opt.add_param_group({"params": extra.parameters()})
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    got = fqn_cache.state_dicts(model, [opt])
    assert len(asked) == 2 and fqn_cache._same(got, get_state_dict(model, [opt]))
    assert "3.weight" in got[0] and "3.weight" in got[1]["state"]
    model[0].weight = nn.Parameter(
        model[0].weight.detach().clone()
    )  # replaced: the optimizer has the old one
    with pytest.raises(Exception):  # noqa: B017 - whatever torch raises, it is torch's answer, not a stale name
        get_state_dict(model, [opt])
    with pytest.raises(Exception):  # noqa: B017
        fqn_cache.state_dicts(model, [opt])
    assert len(asked) == 3


def test_parameters_trading_places_ask_torch_again(asked: list[int]) -> None:
    # The same parameters, the same keys: only which module holds which changed. The names learned before
    # would be wrong (the optimizer's state follows the parameter), so torch is asked again.
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    opt = torch.optim.Adam(model.parameters())
    _step(model, [opt])
    fqn_cache.state_dicts(model, [opt])
    model[0].weight, model[1].weight = model[1].weight, model[0].weight
    got = fqn_cache.state_dicts(model, [opt])
    assert len(asked) == 2 and fqn_cache._same(got, get_state_dict(model, [opt]))


def test_a_renaming_wrapper_is_left_to_torch(asked: list[int]) -> None:
    # torch.compile's wrapper: its state-dict keys carry "_orig_mod.", which torch's names do not.
    inner = _mlp()
    model = torch.compile(inner)  # not run: only its state-dict keys matter here
    opt = torch.optim.Adam(model.parameters())
    inner(torch.randn(3, 4)).sum().backward()
    opt.step()
    for _ in range(2):
        got = fqn_cache.state_dicts(model, [opt])
        assert fqn_cache._same(got, get_state_dict(model, [opt]))
        assert list(got[0]) == list(inner.state_dict())
    assert len(asked) == 2
