"""Named state sections: several models (an EMA copy, a GAN's second model), their optimizers and named
Stateful objects, saved with stable keys beside ``model``/``optimizer``.

torchrun: a 2-rank FSDP2 job saves an EMA and a second model with its optimizer as named sections; a 1-rank
job restores them bitwise (tests/dist/sections_worker.py).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import safepoint
from tests.conftest import REPO
from tests.helpers.launch import assert_bitwise, events, finish, load, start

WORKER = REPO / "tests" / "dist" / "sections_worker.py"


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = int(sd["n"])


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _keys(root: Path, step: int) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return sorted(FileSystemReader(str(root / f"step-{step}")).read_metadata().state_dict_metadata)


def _state(seed: int, counter: Counter, **kw: Any) -> tuple[safepoint.TrainState, list[nn.Module]]:
    model, ema, disc = _net(seed), _net(seed + 1), _net(seed + 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    disc_opt = torch.optim.SGD(disc.parameters(), lr=0.1, momentum=0.9)
    for m, o in ((model, opt), (disc, disc_opt)):
        m(torch.randn(3, 4)).sum().backward()
        o.step()
    state = safepoint.TrainState(
        model=model,
        optimizer=opt,
        modules={"ema": ema, "disc": disc},
        optimizers={"disc": disc_opt},
        objects={"counter": counter},
        **kw,
    )
    return state, [model, ema, disc]


def test_named_sections_round_trip_with_stable_keys(root: Path) -> None:
    saved_counter, fresh_counter = Counter(), Counter()
    saved_counter.n = 41
    state, models = _state(0, saved_counter)
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(5, state)
    keys = _keys(root, 5)
    # model/optimizer keep their keys; each named section lives under its own name.
    assert "model.0.weight" in keys and "modules.ema.0.weight" in keys and "modules.disc.2.bias" in keys
    assert "optimizers.disc.state.0.weight.momentum_buffer" in keys and "objects.counter.n" in keys
    assert not any(k.startswith("optimizers.ema") for k in keys)
    manifest = json.loads((root / "step-5" / "safepoint.json").read_text())
    assert {"modules.ema", "modules.disc", "optimizers.disc", "objects.counter"} <= set(manifest["keys"])

    fresh, fresh_models = _state(10, fresh_counter)
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(fresh) == 5
    for a, b in zip(models, fresh_models, strict=True):
        assert_bitwise(a.state_dict(), b.state_dict())
    assert fresh_counter.n == 41
    assert_bitwise(
        state.optimizers["disc"].state_dict(),  # type: ignore[index, union-attr]
        fresh.optimizers["disc"].state_dict(),  # type: ignore[index, union-attr]
    )


def test_a_section_added_later_leaves_older_checkpoints_loadable(root: Path) -> None:
    old_model = _net(0)
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(3, safepoint.TrainState(model=old_model))
    state, (model, ema, _) = _state(10, Counter())
    state.optimizer = None
    ema_before = {k: v.clone() for k, v in ema.state_dict().items()}
    with safepoint.CheckpointManager(root) as mgr, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mgr.restore(state) == 3
    assert_bitwise(model.state_dict(), old_model.state_dict())
    assert_bitwise(ema.state_dict(), ema_before)  # left as initialised
    said = " ".join(str(w.message) for w in caught)
    assert "'modules.ema'" in said and "'objects.counter'" in said


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"modules": {"a.b": nn.Linear(1, 1)}}, "letters, digits"),
        ({"modules": {"ema": object()}}, "must be an nn.Module"),
        ({"optimizers": {"ema": torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1)}}, "needs modules="),
        ({"objects": {"c": 3}}, "state_dict() and load_state_dict()"),
        ({"modules": [nn.Linear(1, 1)]}, "must be a dict"),
    ],
)
def test_bad_named_sections_are_refused_when_built(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=None) as e:
        safepoint.TrainState(**kw)
    assert message in str(e.value)


@pytest.mark.timeout(600)
@pytest.mark.slow  # time bar of the default suite: torchrun at two world sizes; named sections run in-process by default
def test_fsdp2_ema_as_a_named_section_reshards_2_to_1_bitwise(tmp_path: Path) -> None:
    root = tmp_path / "root"
    rc, log = finish(
        tmp_path, "two", start(WORKER, tmp_path, "two", [{"name": "save", "root": str(root), "mode": "save"}])
    )
    assert rc == 0, log[-4000:]
    [refused] = events(tmp_path, "save", "extra_refused", rank=0)
    assert "modules={'ema': module}" in refused["msg"] and "sharded tensor" in refused["msg"]
    jobs = [{"name": "load", "root": str(root), "mode": "load"}]
    rc, log = finish(tmp_path, "one", start(WORKER, tmp_path, "one", jobs, nproc=1))
    assert rc == 0, log[-4000:]
    assert [e["step"] for e in events(tmp_path, "load", "done")] == [3]
    saved, restored = load(tmp_path / "save.pt"), load(tmp_path / "load.pt")
    assert saved["meta"] == restored["meta"] == 30
    assert_bitwise(restored, saved)
