"""A restored optimizer is loaded by torch's own ``Optimizer.load_state_dict``, fed saved groups whose
``params`` answer ``in`` from a set (safepoint/data/optim_load.py ``fast_membership``): the same state, bit
for bit, as the plain load (every cast rule: the parameters' dtype, ``step`` kept or made float32 for
capturable/fused groups, each group's hyperparameters), without torch's per-value scan of every group's
``params`` list (quadratic in the number of parameters, issue 27). Also: the cyclic GC comes back as it
was after a restore that raises."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import safepoint
from safepoint.data.optim_load import fast_membership, in_order
from safepoint.data.plain import load_stateful
from safepoint.errors import StateMismatchError

Factory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, Factory] = {
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True),
    "adam-fused": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True),
    "adamw-two-groups": lambda p: torch.optim.AdamW(
        [
            {"params": p[:3], "lr": 1e-2, "betas": (0.8, 0.9)},
            {"params": p[3:], "weight_decay": 0.5, "eps": 1e-6},
        ],
        lr=1e-3,
    ),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),  # no momentum: no state at all
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
}


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.Linear(4, 2))


def _trained(kind: str, no_state: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Two steps; with ``no_state`` the last layer never gets a gradient, so it has no state."""
    torch.manual_seed(0)
    model = _model()
    opt = OPTIMIZERS[kind](list(model.parameters()))
    for _ in range(2):
        out = model[:3](torch.randn(3, 4)) if no_state else model(torch.randn(3, 4))
        out.pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _fresh(kind: str, dtype: torch.dtype) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Another model (other values, maybe another dtype) and a fresh optimizer with other hyperparameters:
    what the load must overwrite."""
    torch.manual_seed(1)
    model = _model().to(dtype)
    opt = OPTIMIZERS[kind](list(model.parameters()))
    for group in opt.param_groups:
        group["lr"] = 0.5
    return model, opt


def _same(got: torch.optim.Optimizer, want: torch.optim.Optimizer) -> None:
    """Bit for bit: every state tensor's values, dtype and device, and every group's hyperparameters."""
    a, b = got.state_dict(), want.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k, values in b["state"].items():
        assert a["state"][k].keys() == values.keys(), k
        for name, t in values.items():
            mine = a["state"][k][name]
            if isinstance(t, torch.Tensor):
                assert (mine.dtype, mine.device, mine.shape) == (t.dtype, t.device, t.shape), (k, name)
                assert torch.equal(mine, t), (k, name)
            else:
                assert mine == t, (k, name)


CASES = [(kind, torch.float32, False) for kind in OPTIMIZERS]
CASES += [("adam", torch.float64, False), ("adam-fused", torch.float64, False), ("adam", torch.float32, True)]


@pytest.mark.parametrize(("kind", "dtype", "no_state"), CASES)
def test_the_index_keyed_load_equals_torchs(kind: str, dtype: torch.dtype, no_state: bool) -> None:
    """The template-free path (an optimizer without a model: its own state dict, keyed by index)."""
    _, source = _trained(kind, no_state)
    saved = source.state_dict()
    _, plain = _fresh(kind, dtype)
    plain.load_state_dict(copy.deepcopy(saved))
    _, fast = _fresh(kind, dtype)
    load_stateful(fast, copy.deepcopy(saved))
    _same(fast, plain)
    if kind.startswith("adam") and dtype == torch.float64:  # the cast rules were exercised
        state = next(iter(fast.state.values()))
        assert state["exp_avg"].dtype == torch.float64
        assert state["step"].dtype == torch.float32  # kept (plain) or made float32 (fused), never float64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_capturable_groups_get_their_step_as_torch_gives_it(dtype: torch.dtype) -> None:
    """A group saved with ``capturable=True`` (a CUDA run's) makes ``step`` a float32 tensor on the
    parameter's device; other values take the parameter's dtype. (Capturable Adam cannot step on a CPU:
    the saved flag is set on a CPU run's state dict.)"""
    _, source = _trained("adam")
    saved = source.state_dict()
    for group in saved["param_groups"]:
        group["capturable"] = True
    for state in saved["state"].values():
        state["step"] = state["step"].to(torch.float64)  # to see the cast
    targets = []
    for load in (lambda o, sd: o.load_state_dict(sd), load_stateful):
        model = _model().to(dtype)
        opt = torch.optim.Adam(model.parameters(), lr=0.5, capturable=True)
        load(opt, copy.deepcopy(saved))
        targets.append(opt)
    _same(targets[1], targets[0])
    state = next(iter(targets[1].state.values()))
    assert state["step"].dtype == torch.float32 and state["exp_avg"].dtype == dtype


@pytest.mark.parametrize(
    ("kind", "dtype"), [(k, torch.float32) for k in OPTIMIZERS] + [("adam", torch.float64)]
)
def test_the_fqn_keyed_load_equals_set_state_dicts(kind: str, dtype: torch.dtype) -> None:
    """The path of a restore with a model: ``in_order`` (when it applies) against ``set_state_dict``."""
    source_model, source = _trained(kind)
    _, saved = get_state_dict(source_model, [source])
    results = []
    for ordered in (True, False):
        model, opt = _fresh(kind, dtype)
        loaded = copy.deepcopy(saved)
        if ordered:
            load = in_order(model, [opt], loaded)
            if kind == "sgd":  # no state: set_state_dict's own path (its split returns at once)
                assert load is None
                return
            assert load is not None
            load()
        else:
            set_state_dict(model, [opt], model_state_dict={}, optim_state_dict=loaded)
        results.append(opt)
    _same(results[0], results[1])


class _Key(str):
    """A parameter's FQN that counts the ``==`` comparisons made with it."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        _Key.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_the_load_makes_a_linear_number_of_comparisons() -> None:
    """Without the set, ``Optimizer.load_state_dict`` compares each state value's FQN with the group's
    list up to its position: ~3 x N^2 / 2 comparisons for Adam (135,000 here); with it, a few per value."""
    n = 300
    model = nn.ParameterList([nn.Parameter(torch.randn(2)) for _ in range(n)])
    opt = torch.optim.Adam(model.parameters())
    for p in model:
        p.grad = torch.ones_like(p)
    opt.step()
    _, sd = get_state_dict(model, [opt])
    saved: dict[str, Any] = dict(sd)
    keys = {k: _Key(k) for k in saved["state"]}  # the same objects in "state" and "params", as DCP's are
    saved["state"] = {keys[k]: v for k, v in saved["state"].items()}
    for group in saved["param_groups"]:
        group["params"] = [keys[k] for k in group["params"]]
    fresh = torch.optim.Adam(model.parameters(), lr=0.5)
    load = in_order(model, [fresh], saved)
    assert load is not None
    _Key.compared = 0
    load()
    assert _Key.compared < 10 * n, _Key.compared
    _same(fresh, opt)


def test_the_index_keyed_load_scans_no_list() -> None:
    """The template-free path hands ``load_state_dict`` groups whose ``in`` is a set lookup (seen from a
    load pre-hook, which runs on what the scan later reads)."""
    _, source = _trained("adamw-two-groups")
    seen: list[Any] = []
    _, fresh = _fresh("adamw-two-groups", torch.float32)
    fresh.register_load_state_dict_pre_hook(
        lambda o, sd: seen.extend(g["params"] for g in sd["param_groups"])
    )
    load_stateful(fresh, copy.deepcopy(source.state_dict()))
    assert len(seen) == 2
    for params in seen:
        assert type(params).__contains__ is not list.__contains__
        assert list(params) == sorted(params) and all(i in params for i in params) and -1 not in params


def test_membership_answers_as_the_list_would() -> None:
    """After an edit (a pre-hook may edit the list), with unhashable entries, across groups."""
    groups = fast_membership([{"params": ["a", "b"], "lr": 1.0}, {"params": [[1], "c"]}, "other"])
    first, second = groups[0]["params"], groups[1]["params"]
    assert "a" in first and "c" not in first
    first.append("c")
    assert "c" in first
    assert [1] in second and "c" in second and "a" not in second
    assert groups[2] == "other" and groups[0]["lr"] == 1.0
    copied = copy.deepcopy(first)
    assert type(copied) is list and copied == ["a", "b", "c"]


def test_a_restore_equals_torch_load_state_dict(root: Path) -> None:
    """End to end through the manager: two groups with their own hyperparameters, amsgrad, fp64."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).double()
    params = list(model.parameters())
    groups: list[dict[str, Any]] = [
        {"params": params[:2], "lr": 1e-2, "amsgrad": True},
        {"params": params[2:], "betas": (0.5, 0.6)},
    ]
    opt = torch.optim.Adam(groups)
    for _ in range(3):
        model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
        opt.step()
        opt.zero_grad()
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(3, safepoint.TrainState(model=model, optimizer=opt, rng=False))
    want_model = copy.deepcopy(model)
    mine = list(want_model.parameters())
    want_groups: list[dict[str, Any]] = [{"params": mine[:2], "amsgrad": True}, {"params": mine[2:]}]
    want = torch.optim.Adam(want_groups)
    want.load_state_dict(copy.deepcopy(opt.state_dict()))
    torch.manual_seed(5)
    model2 = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).double()
    params2 = list(model2.parameters())
    groups2: list[dict[str, Any]] = [{"params": params2[:2], "amsgrad": True}, {"params": params2[2:]}]
    opt2 = torch.optim.Adam(groups2, lr=0.5)
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(model=model2, optimizer=opt2, rng=False)) == 3
    _same(opt2, want)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.fixture
def gc_state() -> Iterator[None]:
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


class _Probe:
    """An ``extra`` object whose ``state_dict()`` (asked while the restore shapes its load, outside torch's
    own ``get_state_dict``, which holds the collector off by itself) records whether the GC was on."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def state_dict(self) -> dict[str, Any]:
        self.seen.append(gc.isenabled())
        return {"v": 1}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


@pytest.mark.parametrize("enabled", [True, False])
def test_the_gc_setting_comes_back_after_a_restore_that_raises(
    root: Path, gc_state: None, enabled: bool
) -> None:
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, safepoint.TrainState(model=nn.Linear(4, 2), extra={"probe": _Probe()}, rng=False))
    (gc.enable if enabled else gc.disable)()
    probe = _Probe()
    other = nn.Linear(4, 3)  # another shape: the restore refuses it, from inside the paused block
    state = safepoint.TrainState(model=other, extra={"probe": probe}, rng=False)
    probe.seen.clear()  # (TrainState checks the object when made)
    with safepoint.CheckpointManager(root) as mgr, pytest.raises(StateMismatchError):
        mgr.restore(state)
    assert probe.seen == [False]  # held off during the restore
    assert gc.isenabled() is enabled
