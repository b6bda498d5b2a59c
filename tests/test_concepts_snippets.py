"""The snippets of docs/concepts.md that are complete programs run as written: custom Stateful objects and
``torch.compile``d models (save compiled, restore plain)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader

import safepoint
from tests.conftest import REPO, SUBPROCESS_ENV


def snippet(heading: str) -> str:
    """The first ```python block after ``heading`` in docs/concepts.md."""
    text = (REPO / "docs" / "concepts.md").read_text()
    after = text[text.index(f"\n{heading}\n") :]
    found = re.search(r"```python\n(.*?)```", after, re.S)
    assert found, f"no python block after {heading}"
    return found.group(1)


@pytest.mark.parametrize(
    "heading",
    [
        "### Your own Stateful objects",
        "### Restoring without a template: `PlainState`, fresh optimizers",
        "### `torch.compile`d models",
        "### `save(N)` for a step that is already committed",
    ],
)
def test_concepts_snippet_runs(heading: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet(heading), heading, "exec"), {"__name__": "snippet"})  # its asserts are the test


def _build() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def _trained(model: torch.nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return opt


@pytest.mark.parametrize("compiled_side", ["save", "restore"])
def test_compiled_and_plain_modules_share_keys_and_round_trip(compiled_side: str, tmp_path: Path) -> None:
    """Model, optimizer and a named module, trained through a compiled forward (eager backend: the keys do
    not depend on the backend), restored bitwise into the other kind."""
    torch.manual_seed(0)
    src, src_ema = _build(), _build()
    dst, dst_ema = _build(), _build()

    def wrap(m: torch.nn.Module, side: str) -> torch.nn.Module:
        return torch.compile(m, backend="eager") if side == compiled_side else m

    opt = _trained(wrap(src, "save"))
    with safepoint.CheckpointManager(tmp_path) as mgr:
        mgr.save(
            1,
            safepoint.TrainState(
                model=wrap(src, "save"), optimizer=opt, modules={"ema": wrap(src_ema, "save")}
            ),
        )
    # The checkpoint's keys are the plain module's, whichever side was compiled.
    keys = set(FileSystemReader(tmp_path / "step-1").read_metadata().state_dict_metadata)
    assert {"model.0.weight", "modules.ema.2.bias", "optimizer.state.0.weight.exp_avg"} <= keys
    assert not [k for k in keys if "_orig_mod" in k]
    with safepoint.CheckpointManager(tmp_path) as mgr:
        target = wrap(dst, "restore")
        dst_opt = torch.optim.AdamW(target.parameters())
        state = safepoint.TrainState(
            model=target, optimizer=dst_opt, modules={"ema": wrap(dst_ema, "restore")}
        )
        assert mgr.restore(state) == 1
    for a, b in ((src, dst), (src_ema, dst_ema)):
        for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            assert ka == kb and torch.equal(va, vb)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], dst_opt.state_dict()["state"][0]["exp_avg"])


class _Counts:
    """A Stateful whose nested dict gains keys during the run: the case concepts.md warns about."""

    def __init__(self) -> None:
        self.by_task: dict[str, int] = {}

    def state_dict(self) -> dict[str, object]:
        return {"by_task": dict(self.by_task)}

    def load_state_dict(self, sd: dict[str, object]) -> None:
        self.by_task = dict(sd["by_task"])  # type: ignore[call-overload]


def test_a_nested_dict_with_new_keys_is_reported_as_concepts_md_says(tmp_path: Path) -> None:
    saved = _Counts()
    saved.by_task = {"code": 3}
    with safepoint.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, safepoint.TrainState(objects={"progress": saved}, rng=False))
        with pytest.raises(
            safepoint.StateMismatchError, match=r"not in the target: objects\.progress\.by_task\.code"
        ):
            mgr.restore(safepoint.TrainState(objects={"progress": _Counts()}, rng=False))


_WRAPPED = """
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
import safepoint

store, tmp = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
build = lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
compile = lambda m: torch.compile(m, backend="eager")
def fsdp(m):
    fully_shard(m, mesh=mesh)
    return m
wrappings = {
    "compile(DDP)": lambda m: compile(DDP(m)),
    "DDP(compile)": lambda m: DDP(compile(m)),
    "compile(fully_shard)": lambda m: compile(fsdp(m)),
    "fully_shard(compile)": lambda m: fsdp(compile(m)),
}
for i, (name, wrap) in enumerate(wrappings.items()):
    torch.manual_seed(i)
    inner = build()
    wrapped = wrap(inner)
    opt = torch.optim.AdamW(wrapped.parameters())
    wrapped(torch.randn(3, 4)).sum().backward()
    opt.step()
    with safepoint.CheckpointManager(f"{tmp}/{i}") as mgr:
        mgr.save(1, safepoint.TrainState(model=wrapped, optimizer=opt, rng=False))
    plain = build()
    with safepoint.CheckpointManager(f"{tmp}/{i}") as mgr:
        mgr.restore(safepoint.TrainState(model=plain, optimizer=torch.optim.AdamW(plain.parameters()), rng=False))
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
    same = all(torch.equal(full(p), q) for p, q in zip(inner.parameters(), plain.parameters(), strict=True))
    print(name, "bitwise" if same else "differs", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow  # time bar of the default suite: torchrun; the in-process compile/wrapper cases run by default
def test_compile_wrapped_with_ddp_or_fsdp2_either_way_restores_into_a_plain_module(tmp_path: Path) -> None:
    """concepts.md: the order of torch.compile and DDP/fully_shard does not change the saved keys."""
    script = tmp_path / "wrapped.py"
    script.write_text(_WRAPPED)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:-1] == [
        "compile(DDP) bitwise",
        "DDP(compile) bitwise",
        "compile(fully_shard) bitwise",
        "fully_shard(compile) bitwise",
    ], proc.stdout + proc.stderr[-3000:]
