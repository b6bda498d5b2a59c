"""A save whose state keeps its structure does not rebuild DCP's local plan (save/plan_reuse.py); any change
of a key, shape or dtype between saves is planned afresh, and every checkpoint restores exactly and stays
readable by plain ``dcp.load``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import default_planner
from torch.distributed.checkpoint.planner import WriteItemType

import safepoint
from safepoint.save.plan_reuse import PlanRecord, ReusingSavePlanner, structure_of
from tests.helpers.holder import Holder


@pytest.fixture
def plans_built(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many local plans DCP built (one entry, the item count, per build)."""
    built: list[int] = []
    real = default_planner.create_default_local_save_plan

    def counting(state_dict: dict[str, Any], is_coordinator: bool) -> Any:
        plan = real(state_dict, is_coordinator)
        built.append(len(plan.items))
        return plan

    monkeypatch.setattr(default_planner, "create_default_local_save_plan", counting)
    return built


def test_one_plan_is_not_deduplicated_and_is_what_dcp_returns(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DCP's dedup of a single plan is the identity after a pass over every item (save/plan_reuse.py):
    # the planner hands the plan back itself, equal to DCP's answer, and a save in one process never
    # runs DCP's dedup (the first save of 40,000 items: ~0.3 s less).
    real = default_planner.dedup_save_plans
    deduped: list[int] = []

    def counting(plans: list[Any], *args: Any) -> Any:
        deduped.append(len(plans))
        return real(plans, *args)

    monkeypatch.setattr(default_planner, "dedup_save_plans", counting)
    model = Params(**{f"p{i}": torch.randn(3, 2) for i in range(6)})
    opt = _stepped_adam(model)
    state_dict = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": {"tokens": 7}}
    planner = ReusingSavePlanner("test-one-plan", PlanRecord())
    planner.set_up_planner(state_dict, is_coordinator=True)
    plan = planner.create_local_plan()
    assert any(i.type == WriteItemType.BYTE_IO for i in plan.items)
    got = planner._dedup_save_plans([plan])
    assert got == real([plan])
    assert got[0] is not plan and got[0].items == plan.items and got[0].items is not plan.items
    assert deduped == []
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, safepoint.TrainState(model=model, optimizer=opt, rng=False))
        mgr.save(2, safepoint.TrainState(model=Params(x=torch.ones(2)), rng=False))  # a new plan
    assert deduped == []
    got_back = _restored(root, 1, model)
    for k, v in model.state_dict().items():
        assert torch.equal(got_back[k], v)


class Params(nn.Module):
    def __init__(self, **tensors: torch.Tensor) -> None:
        super().__init__()
        for name, t in tensors.items():
            self.register_parameter(name, nn.Parameter(t))


def _stepped_adam(model: torch.nn.Module) -> torch.optim.Adam:
    """An Adam optimizer of ``model`` after one step: its state (step, moments) exists."""
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


def _restored(root: Path, step: int, like: Params) -> dict[str, torch.Tensor]:
    target = Params(**{k: torch.zeros_like(v) for k, v in like.state_dict().items()})
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(model=target, rng=False), step=step) == step
    return target.state_dict()


def test_an_unchanged_state_is_not_replanned(root: Path, plans_built: list[int]) -> None:
    model = Params(**{f"p{i}": torch.randn(4, 4) for i in range(20)})
    opt = _stepped_adam(model)
    state = safepoint.TrainState(model=model, optimizer=opt, rng=False)
    with safepoint.CheckpointManager(root) as mgr:
        for step in (1, 2, 3, 4):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            mgr.save(step, state)
    # The first save builds the plan (and DCP caches it); the later ones are proven unchanged without it.
    assert len(plans_built) == 1
    got = _restored(root, 4, model)
    for k, v in model.state_dict().items():
        assert torch.equal(got[k], v)


@pytest.mark.parametrize(
    "change",
    ["shape", "dtype", "key", "tensor_to_value"],
)
def test_a_changed_structure_is_planned_afresh_and_restores_exactly(
    root: Path, plans_built: list[int], change: str
) -> None:
    model = Params(a=torch.randn(3, 4), b=torch.randn(5))
    state = safepoint.TrainState(model=model, rng=False, objects={"o": Holder(torch.ones(2))})
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        mgr.save(3, state)
        before = len(plans_built)
        if change == "shape":
            model.a = nn.Parameter(torch.randn(4, 3))  # same number of elements, another shape
        elif change == "dtype":
            model.a = nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
        elif change == "key":
            del model.a
            model.c = nn.Parameter(torch.randn(3, 4))
        else:
            state.objects["o"].v = 7  # type: ignore[index]  # a tensor item becomes a byte item
        mgr.save(4, state)
        # A dtype change: DCP's first plan, found "equal" by its cache (no dtype compared), is built again
        # as a new one (test_a_dtype_change_of_the_same_shape_is_recorded_in_the_metadata).
        assert len(plans_built) == before + (2 if change == "dtype" else 1)
        mgr.save(5, state)
    got = _restored(root, 5, model)
    assert got.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v)
    # The files are DCP's own: plain dcp.load reads the model back bitwise.
    plain = {f"model.{k}": torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(plain, checkpoint_id=str(root / "step-5"), no_dist=True)
    for k, v in model.state_dict().items():
        assert torch.equal(plain[f"model.{k}"], v)


@pytest.mark.parametrize("how", ["model", "step"])
def test_a_dtype_change_of_the_same_shape_is_recorded_in_the_metadata(
    root: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """DCP's plan cache compares a new local plan with the cached one by index, size and chunk only, not
    by dtype: a tensor that changed dtype at the same shape (a model cast to float64 or bfloat16 mid-run,
    Adam's step made an integer) was found "unchanged", the cached plan and .metadata of the old dtype
    reused, and that structure recorded as the cached plan's. The bytes were right (each item is a
    torch.save record of its own), so restore worked, but ``safepoint verify`` called the checkpoint
    corrupt, and whatever builds tensors from .metadata (export, DCP's own converters) cast the values
    to the old dtype. The planner now checks the tensor properties DCP does not."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from safepoint.cli.main import main

    model = Params(a=torch.randn(3, 4), b=torch.randn(5))
    opt = _stepped_adam(model)
    state = safepoint.TrainState(model=model, optimizer=opt, rng=False)
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        if how == "model":
            model.to(torch.float64)
            key, want = "model.a", torch.float64
        else:
            for s in opt.state.values():
                s["step"] = s["step"].to(torch.int64)
            key, want = "optimizer.state.a.step", torch.int64
        mgr.save(3, state)
        mgr.save(4, state)
    for step in (3, 4):
        md = FileSystemReader(str(root / f"step-{step}")).read_metadata().state_dict_metadata
        assert md[key].properties.dtype == want, step  # type: ignore[union-attr]
    capsys.readouterr()
    assert main(["verify", str(root), "--all"]) == 0, capsys.readouterr().out


def test_the_structure_covers_what_a_write_item_holds() -> None:
    base = {"a": torch.zeros(2, 3), "b": 1}
    paths = {"a": ("a",), "b": ("b",)}
    s = structure_of(base, paths, True)
    assert s is not None and s == structure_of(dict(base), dict(paths), True)
    variants: list[tuple[dict[str, Any], dict[str, Any], bool]] = [
        ({"a": torch.zeros(3, 2), "b": 1}, paths, True),
        ({"a": torch.zeros(2, 3, dtype=torch.int32), "b": 1}, paths, True),
        ({"a": torch.zeros(2, 3, requires_grad=True), "b": 1}, paths, True),
        ({"b": 1, "a": torch.zeros(2, 3)}, paths, True),  # the order of the items
        ({"a": torch.zeros(2, 3), "b": torch.zeros(1)}, paths, True),
        (base, {"a": ("x", "a"), "b": ("b",)}, True),  # the same key from another nesting
        (base, paths, False),
    ]
    for sd, p, coordinator in variants:
        assert structure_of(sd, p, coordinator) != s
    # A subclass (a Parameter here; a DTensor alike) cannot be proven: DCP plans.
    assert structure_of({"a": nn.Parameter(torch.zeros(2))}, {"a": ("a",)}, True) is None


def test_unchanged_byte_items_are_not_serialised_again_and_changed_ones_are(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A non-tensor item (lr, betas, weight_decay...) is torch.save'd once and its bytes reused while its
    # value pickles alike (store/item_writer.py byte_item); a changed value, or an equal one of another
    # type (1 vs 1.0), is serialised again and restored exactly, and plain dcp.load reads every step.
    serialised: list[str] = []
    real = default_planner.DefaultSavePlanner.resolve_data

    def counting(self: Any, item: Any) -> Any:
        if item.type == WriteItemType.BYTE_IO:
            serialised.append(item.index.fqn)
        return real(self, item)

    monkeypatch.setattr(default_planner.DefaultSavePlanner, "resolve_data", counting)
    model = Params(w=torch.randn(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    state = safepoint.TrainState(model=model, optimizer=opt, rng=False)
    lrs = [0.5, 0.5, 0.25, 1, 1.0]
    with safepoint.CheckpointManager(root) as mgr:
        counts = []
        for step, lr in enumerate(lrs, start=1):
            opt.param_groups[0]["lr"] = lr
            serialised.clear()
            mgr.save(step, state)
            counts.append(sum(1 for k in serialised if k.endswith(".lr")))
    # Step 1 serialises lr; step 2 reuses it; 0.25 is new; 1 is new; 1.0 == 1 but pickles differently.
    assert counts == [1, 0, 1, 1, 1]
    assert len(serialised) == 1  # the last save serialised only the changed lr: every other item reused
    for step, lr in enumerate(lrs, start=1):
        target = Params(w=torch.zeros(4, 4))
        fresh = torch.optim.SGD(target.parameters(), lr=9.0)
        with safepoint.CheckpointManager(root) as mgr:
            mgr.restore(safepoint.TrainState(model=target, optimizer=fresh, rng=False), step=step)
        got = fresh.param_groups[0]["lr"]
        assert got == lr and type(got) is type(lr)
        sd: dict[str, Any] = {"model": {"w": torch.zeros(4, 4)}}
        dcp.load(sd, checkpoint_id=str(root / f"step-{step}"), no_dist=True)
        assert torch.equal(sd["model"]["w"], model.state_dict()["w"])


def test_the_flattened_state_is_dcps_without_a_second_walk_for_sharded_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DCP walks every value a second time looking for nested ShardedTensors; with none in the flattened
    state the planner skips that walk, and its state dict is DCP's own: the same keys, order and values."""
    from safepoint.save import plan_reuse

    state = {"model": {"w": torch.ones(2), "b": [torch.zeros(1), torch.ones(1)]}, "extra": {"n": 3, "l": [1]}}
    dcps = default_planner.DefaultSavePlanner()
    dcps.set_up_planner(state_dict=state, is_coordinator=True)
    walks: list[object] = []
    real = default_planner._flatten_sharded_tensors
    monkeypatch.setattr(default_planner, "_flatten_sharded_tensors", lambda sd: walks.append(sd) or real(sd))
    ours = plan_reuse.ReusingSavePlanner("test-key", plan_reuse.PlanRecord())
    ours.set_up_planner(state_dict=state, is_coordinator=True)
    assert walks == []
    assert list(ours.state_dict) == list(dcps.state_dict)
    assert all(ours.state_dict[k] is v for k, v in dcps.state_dict.items())
    assert ours.mappings == dcps.mappings and ours.flatten_sharded_tensors
