"""A module whose state-dict hooks rename keys (safepoint/data/module_state.py), without torchtitan: one fused
parameter saved as two stock keys, as torchtitan's ``FusedQKVLinear`` saves ``wqkv`` as ``wq``/``wk``/``wv``
(tests/integrations/test_torchtitan_fused.py runs the real one). DCP's ``get_state_dict`` fails on such keys;
the module is saved with its own ``state_dict()`` and loaded through its own ``load_state_dict``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

import safepoint
from safepoint.data import module_state


class Fused(nn.Module):
    """``ab`` (one parameter) saved as ``a`` and ``b``, merged back on load."""

    def __init__(self) -> None:
        super().__init__()
        self.ab = nn.Parameter(torch.randn(4, 3))
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._merge)

    @staticmethod
    def _split(module: nn.Module, sd: dict[str, Any], prefix: str, _meta: Any) -> None:
        fused = sd.pop(f"{prefix}ab")
        sd[f"{prefix}a"], sd[f"{prefix}b"] = fused[:2].clone(), fused[2:].clone()

    @staticmethod
    def _merge(module: nn.Module, sd: dict[str, Any], prefix: str, *_args: Any) -> None:
        if f"{prefix}a" in sd:
            sd[f"{prefix}ab"] = torch.cat([sd.pop(f"{prefix}a"), sd.pop(f"{prefix}b")])


def _job(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 3), Fused())
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def test_a_module_whose_hooks_rename_keys_saves_and_restores_bitwise(root: Path) -> None:
    model, opt = _job(0)
    with pytest.raises(AttributeError, match="no attribute 'a'"):
        get_state_dict(model, [opt])  # what safepoint used to call, and failed on
    (model[0](torch.ones(1, 3)).sum() + model[1].ab.pow(2).sum()).backward()  # every parameter steps
    opt.step()
    with safepoint.CheckpointManager(root, async_save=True) as mgr:
        mgr.save(1, safepoint.TrainState(model=model, optimizer=opt, rng=False))
    fresh, fresh_opt = _job(1)
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(model=fresh, optimizer=fresh_opt, rng=False)) == 1
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters(), strict=True))
    got, want = fresh_opt.state_dict(), opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for i, s in want["state"].items():
        assert all(torch.equal(got["state"][i][k], v) for k, v in s.items())
    # The saved keys are the module's own (hooks applied); the optimizer's, the parameters' names.
    sd, optim_sd = module_state.module_state_dicts(fresh, [fresh_opt])
    assert set(sd) == {"0.weight", "0.bias", "1.a", "1.b"}
    assert set(optim_sd["state"]) == {"0.weight", "0.bias", "1.ab"}


def test_other_modules_keep_dcps_state_dict() -> None:
    model, opt = _job(0)
    plain = nn.Linear(2, 2)
    module_state.module_state_dicts(plain, [])
    module_state.module_state_dicts(model, [opt])
    assert plain not in module_state._RENAMING and model in module_state._RENAMING
