"""Non-strict and partial restores (restore(strict=False, ignore=..., remap=...)) and warm starts
(CheckpointManager(init_from=...)): an older checkpoint stays loadable when the state grows a counter,
renames a layer or switches optimizer, and a new run can start from another run's weights without ever
writing to that run's root."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import safepoint
from tests.helpers.launch import assert_bitwise


def _model(seed: int, head: str = "fc") -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(OrderedDict([("body", nn.Linear(4, 8)), (head, nn.Linear(8, 2))]))


def _trained(seed: int, head: str = "fc", opt_cls: Any = torch.optim.AdamW) -> tuple[nn.Module, Any]:
    model = _model(seed, head)
    opt = opt_cls(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _save(root: Path, step: int, state: safepoint.TrainState) -> None:
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(step, state)


def test_a_counter_added_to_extra_loads_non_strict_and_is_reported(root: Path) -> None:
    model, opt = _trained(0)
    _save(root, 4, safepoint.TrainState(model=model, optimizer=opt, extra={"seen": 7}))
    model2, opt2 = _trained(1)
    extra = {"seen": 0, "tokens": 5}
    state = safepoint.TrainState(model=model2, optimizer=opt2, extra=extra)
    with safepoint.CheckpointManager(root) as mgr:
        with pytest.raises(safepoint.StateMismatchError, match=r"extra\.rank_0\.tokens.*strict=False"):
            mgr.restore(state)
        assert mgr.restore(state, strict=False) == 4
        report = mgr.last_restore
    assert extra == {"seen": 7, "tokens": 5}  # loaded what matched; the new counter left as it was
    assert_bitwise(model2.state_dict(), model.state_dict())
    assert report is not None and report.missing == ("extra.rank_0.tokens",) and not report.complete


def test_a_renamed_layer_loads_through_remap_bitwise(root: Path) -> None:
    model, opt = _trained(0, head="fc")
    _save(root, 3, safepoint.TrainState(model=model, optimizer=opt))
    renamed, opt2 = _trained(1, head="head")
    state = safepoint.TrainState(model=renamed, optimizer=opt2)
    with safepoint.CheckpointManager(root) as mgr:
        with pytest.raises(safepoint.StateMismatchError, match="model.head.weight"):
            mgr.restore(state)
        assert mgr.restore(state, remap=lambda k: k.replace(".fc.", ".head.")) == 3
        report = mgr.last_restore
    assert (
        report is not None and report.complete and ("model.fc.weight", "model.head.weight") in report.remapped
    )
    assert torch.equal(renamed.head.weight, model.fc.weight) and torch.equal(
        renamed.body.bias, model.body.bias
    )
    saved_state, loaded_state = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert_bitwise(loaded_state, saved_state)


def test_a_switched_optimizer_is_ignored(root: Path) -> None:
    model, opt = _trained(0, opt_cls=torch.optim.AdamW)
    _save(root, 2, safepoint.TrainState(model=model, optimizer=opt))
    model2, sgd = _trained(1, opt_cls=lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9))
    before = {k: v.clone() for k, v in sgd.state_dict()["state"][0].items()}
    state = safepoint.TrainState(model=model2, optimizer=sgd)
    with safepoint.CheckpointManager(root) as mgr:
        with pytest.raises(safepoint.StateMismatchError):
            mgr.restore(state)
        assert mgr.restore(state, ignore=["optimizer"]) == 2
        report = mgr.last_restore
    assert_bitwise(model2.state_dict(), model.state_dict())
    assert_bitwise(sgd.state_dict()["state"][0], before)  # the new optimizer's state untouched
    assert report is not None and report.ignored == ("optimizer",)


def test_ignore_patterns_skip_keys_and_bad_arguments_fail_clearly(root: Path) -> None:
    model, _ = _trained(0)
    _save(root, 1, safepoint.TrainState(model=model))
    model2 = _model(5)
    head_before = model2.fc.weight.clone()
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(model=model2), ignore=["model.fc.*"]) == 1
        assert mgr.last_restore is not None and set(mgr.last_restore.ignored) == {
            "model.fc.weight",
            "model.fc.bias",
        }
        with pytest.raises(ValueError, match="list of key patterns"):
            mgr.restore(safepoint.TrainState(model=model2), ignore="optimizer")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="remap"):
            mgr.restore(safepoint.TrainState(model=model2), remap="x")  # type: ignore[arg-type]
    assert torch.equal(model2.fc.weight, head_before) and torch.equal(model2.body.weight, model.body.weight)


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.mark.parametrize("form", ["root", "step_dir", "options"])
def test_warm_start_from_another_root_reads_only_and_yields_to_the_own_checkpoint(
    tmp_path: Path, form: str
) -> None:
    source = tmp_path / "pretrain"
    model, opt = _trained(0)
    _save(source, 9, safepoint.TrainState(model=model, optimizer=opt))
    os.chmod(source, 0o755)
    before = _snapshot(source)
    init: Any = {
        "root": source,
        "step_dir": source / "step-9",
        "options": safepoint.WarmStart(path=str(source), ignore=("optimizer",)),
    }[form]
    run = tmp_path / "finetune"
    model2, sgd = _trained(1, opt_cls=torch.optim.AdamW)
    state = safepoint.TrainState(model=model2, optimizer=sgd)
    with safepoint.CheckpointManager(run, init_from=init) as mgr:
        assert mgr.restore(state) == 0  # a new run: step 0, with the source's weights
        report = mgr.last_restore
        assert report is not None and report.warm_start and report.step == 9
        mgr.save(1, state)
    assert_bitwise(model2.state_dict(), model.state_dict())
    assert _snapshot(source) == before  # nothing written, no lease taken, no .pending created
    assert not (source / ".lease").exists()
    # A restart finds its own checkpoint: the warm start is not applied again.
    model3, opt3 = _trained(2)
    with safepoint.CheckpointManager(run, init_from=init) as mgr:
        assert mgr.restore(safepoint.TrainState(model=model3, optimizer=opt3)) == 1
        assert mgr.last_restore is not None and not mgr.last_restore.warm_start


def test_warm_start_from_nowhere_fails_clearly(tmp_path: Path) -> None:
    with safepoint.CheckpointManager(tmp_path / "run", init_from=tmp_path / "nope") as mgr:
        with pytest.raises(safepoint.CheckpointError, match="init_from=.*does not exist"):
            mgr.restore(safepoint.TrainState(model=_model(0)))
    with pytest.raises(ValueError, match="WarmStart.step"):
        safepoint.WarmStart(path="x", step=-1)


def test_remap_of_two_saved_keys_onto_one_is_an_error_naming_both(root: Path) -> None:
    """Fine-tuning from the EMA: ``modules.ema.*`` -> ``model.*`` while ``model.*`` still maps to itself
    would load whichever comes first in the metadata; it is refused, strict or not, naming both keys."""
    model, ema = _model(0), _model(1)
    _save(root, 1, safepoint.TrainState(model=model, modules={"ema": ema}, rng=False))
    fresh = _model(2)
    before = fresh.state_dict()

    def both(k: str) -> str:
        return "model." + k.removeprefix("modules.ema.") if k.startswith("modules.ema.") else k

    def ema_only(k: str) -> str | None:
        return "model." + k.removeprefix("modules.ema.") if k.startswith("modules.ema.") else None

    with safepoint.CheckpointManager(root) as mgr:
        for strict in (True, False):
            with pytest.raises(
                safepoint.StateMismatchError,
                match=r"'model\.body\.bias' and 'modules\.ema\.body\.bias' onto 'model\.body\.bias'",
            ) as e:
                mgr.restore(safepoint.TrainState(model=fresh, rng=False), strict=strict, remap=both)
            assert "\n" not in str(e.value)
            assert_bitwise(fresh.state_dict(), before)  # nothing loaded
        assert mgr.restore(safepoint.TrainState(model=fresh, rng=False), remap=ema_only) == 1
        report = mgr.last_restore
    assert_bitwise(fresh.state_dict(), ema.state_dict())
    assert report is not None and report.complete
    assert ("modules.ema.fc.weight", "model.fc.weight") in report.remapped and len(report.remapped) == 4


@pytest.mark.parametrize("named", [False, True])
def test_ignoring_the_model_still_loads_its_optimizer(root: Path, named: bool) -> None:
    """``ignore=["model"]`` skips the weights only: the optimizer state (keyed by parameter name) loads."""
    model, opt = _trained(0)
    if named:
        _save(root, 1, safepoint.TrainState(modules={"ema": model}, optimizers={"ema": opt}, rng=False))
    else:
        _save(root, 1, safepoint.TrainState(model=model, optimizer=opt, rng=False))
    model2, opt2 = _trained(1)
    weights = {k: v.clone() for k, v in model2.state_dict().items()}
    if named:
        state = safepoint.TrainState(modules={"ema": model2}, optimizers={"ema": opt2}, rng=False)
    else:
        state = safepoint.TrainState(model=model2, optimizer=opt2, rng=False)
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(state, ignore=["modules.ema" if named else "model"]) == 1
        report = mgr.last_restore
    assert_bitwise(opt2.state_dict()["state"], opt.state_dict()["state"])
    assert_bitwise(model2.state_dict(), weights)  # the weights left as they were
    assert report is not None and report.ignored == ("modules.ema" if named else "model",)
