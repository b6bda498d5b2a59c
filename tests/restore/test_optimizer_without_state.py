"""A parameter the saved optimizer held no state for (it got no gradient before the save: an unused layer,
an expert no token reached) restores into a fresh optimizer as it was saved: without state, every other
value bit for bit, training continuing bit for bit (safepoint/restore/stateless.py). A checkpoint whose
optimizer never covered the parameter is still refused."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import safepoint
from safepoint.errors import CorruptCheckpointError, StateMismatchError
from safepoint.restore.stateless import check_named
from tests.conftest import PYTHON, REPO, SUBPROCESS_ENV
from tests.helpers.s3 import storage_options


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)
        self.late = False  # set: ``unused`` starts receiving gradients

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return y + self.unused(x) if self.late else y


def _make(kind: str = "one") -> tuple[Net, Any]:
    torch.manual_seed(0)
    net = Net()
    if kind == "one":
        return net, torch.optim.AdamW(net.parameters(), lr=1e-2)
    if kind == "groups":
        return net, torch.optim.AdamW(
            [{"params": net.a.parameters(), "lr": 1e-2}, {"params": net.unused.parameters(), "lr": 3e-2}]
        )
    assert kind == "list"  # two optimizers: set_state_dict's split, not the ordered fast path
    weights, biases = [net.a.weight, net.unused.weight], [net.a.bias, net.unused.bias]
    return net, [torch.optim.AdamW(weights, lr=1e-2), torch.optim.AdamW(biases, lr=2e-2)]


def _opts(opt: Any) -> list[torch.optim.Optimizer]:
    return opt if isinstance(opt, list) else [opt]


def _step(net: Net, opt: Any, i: int) -> None:
    g = torch.Generator().manual_seed(100 + i)
    net(torch.randn(3, 4, generator=g)).pow(2).sum().backward()
    for o in _opts(opt):
        o.step()
        o.zero_grad()


def _same_optim(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    assert len(a.state) == len(b.state)
    for k, v in sa["state"].items():
        assert v.keys() == sb["state"][k].keys()
        for name, t in v.items():
            u = sb["state"][k][name]
            assert isinstance(u, torch.Tensor) and t.dtype == u.dtype and torch.equal(t, u), (k, name)


def _same_net(a: nn.Module, b: nn.Module) -> None:
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(p, q), n


def _continue(net: Net, opt: Any, start: int) -> None:
    """Two more steps without ``unused``, then two with it (its state begins there)."""
    for i in range(start, start + 4):
        net.late = i >= start + 2
        _step(net, opt, i)


@pytest.mark.parametrize("kind", ["one", "groups", "list"])
@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("strict", [True, False])
def test_a_parameter_without_state_restores_without_state(
    tmp_path: Path, kind: str, async_save: bool, strict: bool
) -> None:
    net, opt = _make(kind)
    for i in range(2):
        _step(net, opt, i)
    assert not any(p in o.state for o in _opts(opt) for p in net.unused.parameters())
    with safepoint.CheckpointManager(tmp_path, async_save=async_save) as mgr:
        mgr.save(2, safepoint.TrainState(model=net, optimizer=opt))
    net2, opt2 = _make(kind)
    with safepoint.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(safepoint.TrainState(model=net2, optimizer=opt2), strict=strict) == 2
        assert mgr.last_restore is not None and mgr.last_restore.complete
    for o, o2 in zip(_opts(opt), _opts(opt2), strict=True):
        _same_optim(o, o2)
    assert not any(p in o.state for o in _opts(opt2) for p in net2.unused.parameters())
    _same_net(net, net2)
    _continue(net, opt, 2)
    _continue(net2, opt2, 2)
    _same_net(net, net2)
    for o, o2 in zip(_opts(opt), _opts(opt2), strict=True):
        _same_optim(o, o2)


def test_named_modules_and_their_optimizers(tmp_path: Path) -> None:
    net, opt = _make()
    ema, ema_opt = _make("groups")
    for i in range(2):
        _step(net, opt, i)
        _step(ema, ema_opt, i)
    state = safepoint.TrainState(model=net, optimizer=opt, modules={"ema": ema}, optimizers={"ema": ema_opt})
    with safepoint.CheckpointManager(tmp_path) as mgr:
        mgr.save(2, state)
    (net2, opt2), (ema2, ema_opt2) = _make(), _make("groups")
    state2 = safepoint.TrainState(
        model=net2, optimizer=opt2, modules={"ema": ema2}, optimizers={"ema": ema_opt2}
    )
    with safepoint.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(state2) == 2
    _same_optim(opt, opt2)
    _same_optim(ema_opt, ema_opt2)
    _continue(ema, ema_opt, 2)
    _continue(ema2, ema_opt2, 2)
    _same_optim(ema_opt, ema_opt2)
    _same_net(ema, ema2)


@pytest.mark.parametrize("where", ["optimizer", "objects"])
def test_an_optimizer_without_a_model(tmp_path: Path, where: str) -> None:
    """Template-free (data/plain.py): the checkpoint's own keys, never a state the fresh one made up."""
    net, opt = _make()
    for i in range(2):
        _step(net, opt, i)

    def state(o: torch.optim.Optimizer) -> safepoint.TrainState:
        return (
            safepoint.TrainState(optimizer=o)
            if where == "optimizer"
            else safepoint.TrainState(objects={"o": o})
        )

    with safepoint.CheckpointManager(tmp_path) as mgr:
        mgr.save(2, state(opt))
    net2, opt2 = _make()
    net2.load_state_dict(net.state_dict())
    with safepoint.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(state(opt2)) == 2
    _same_optim(opt, opt2)
    _continue(net, opt, 2)
    _continue(net2, opt2, 2)
    _same_optim(opt, opt2)
    _same_net(net, net2)


def test_a_restore_into_an_optimizer_that_has_stepped(tmp_path: Path) -> None:
    """The template then has no state for ``unused`` either; the load still leaves it none (DCP's strict
    split raised a RuntimeError here)."""
    net, opt = _make()
    for i in range(2):
        _step(net, opt, i)
    with safepoint.CheckpointManager(tmp_path) as mgr:
        mgr.save(2, safepoint.TrainState(model=net, optimizer=opt))
    net2, opt2 = _make()
    _step(net2, opt2, 7)  # a state for ``a`` only
    with safepoint.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(safepoint.TrainState(model=net2, optimizer=opt2)) == 2
    _same_optim(opt, opt2)
    _same_net(net, net2)


@pytest.mark.parametrize("strict", [True, False])
def test_a_checkpoint_whose_optimizer_never_had_the_parameter_is_refused(
    tmp_path: Path, strict: bool
) -> None:
    """No ``optimizer.state.unused.*`` key, and the saved param groups do not name ``unused``: the saved
    optimizer never covered it, so its state is missing, not absent by design."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.a.parameters(), lr=1e-2)
    _step(net, opt, 0)
    with safepoint.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, safepoint.TrainState(model=net, optimizer=opt))
    net2, opt2 = _make()
    with safepoint.CheckpointManager(tmp_path) as mgr:
        if strict:
            with pytest.raises(
                StateMismatchError, match=r"missing from the checkpoint: optimizer\.state\.unused"
            ):
                mgr.restore(safepoint.TrainState(model=net2, optimizer=opt2))
        else:
            assert mgr.restore(safepoint.TrainState(model=net2, optimizer=opt2), strict=False) == 1
            report = mgr.last_restore
            assert report is not None and not report.complete
            assert any(k.startswith("optimizer.state.unused.") for k in report.missing)


@pytest.mark.slow  # the default suite is over its time bar: one 2-rank torchrun (~10 s); in-process above
def test_two_ranks_fsdp2_and_ddp(tmp_path: Path) -> None:
    """FSDP2 (sharded: DCP's split, never the ordered fast path) and DDP over real torchrun ranks (gloo)."""
    root, out = tmp_path / "root", tmp_path / "found"
    cmd = [
        PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(REPO / "tests" / "dist" / "stateless_worker.py"), str(root), str(out),
    ]  # fmt: skip
    env = dict(SUBPROCESS_ENV, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        found = json.loads(Path(f"{out}.{rank}").read_text())
        for kind in ("fsdp2", "ddp"):
            assert found[kind]["restored"] == 2, (rank, kind)
            saved, restored = found[kind]["states"]
            assert saved == restored == 2, (rank, kind)  # a.weight and a.bias; unused has none
            assert found[kind]["at_restore"] == [], (rank, kind)
            assert found[kind]["after"] == [], (rank, kind)


def test_param_groups_that_changed_while_read_are_damage() -> None:
    """What the groups read before the load decided is confirmed by the groups the load checked."""
    template = {"optimizer": {"state": {}, "param_groups": [{"params": ["a.weight", "a.bias"]}]}}
    check_named(3, template, {("optimizer",): frozenset({"a.bias"})}, CorruptCheckpointError)
    with pytest.raises(CorruptCheckpointError, match=r"no longer naming \['unused.weight'\]"):
        check_named(3, template, {("optimizer",): frozenset({"unused.weight"})}, CorruptCheckpointError)


def test_an_object_store_root(moto_endpoint: str, bucket: str) -> None:
    """The saved param groups are read by ranged reads of the store's objects (moto S3)."""
    url, opts = f"s3://{bucket}/run", storage_options(moto_endpoint)
    net, opt = _make()
    for i in range(2):
        _step(net, opt, i)
    with safepoint.CheckpointManager(url, storage_options=opts) as mgr:
        mgr.save(2, safepoint.TrainState(model=net, optimizer=opt))
    net2, opt2 = _make()
    with safepoint.CheckpointManager(url, storage_options=opts) as mgr:
        assert mgr.restore(safepoint.TrainState(model=net2, optimizer=opt2)) == 2
    _same_optim(opt, opt2)
    _continue(net, opt, 2)
    _continue(net2, opt2, 2)
    _same_optim(opt, opt2)
