"""Incremental saves with the writer process (async_writer="process", the default for async saves on
Linux): the rank arranges (fingerprints of the staged copies, hard links of the unchanged stable groups),
the real writer process writes only the rest. Real files, real processes, a real SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import safepoint
from safepoint.cli.main import main
from safepoint.store.storage import read_metadata_file

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the process writer is Linux-only")

FROZEN = 256 * 1024  # floats: 1 MiB of frozen base


class Frozen(nn.Module):
    """A frozen base (weight and buffer) and a small trained adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Parameter(torch.randn(FROZEN), requires_grad=False)
        self.register_buffer("table", torch.randn(FROZEN // 4))
        self.adapter = nn.Linear(16, 16)

    def step(self, opt: torch.optim.Optimizer) -> None:
        self.adapter(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()


def _setup() -> tuple[Frozen, torch.optim.Optimizer, safepoint.TrainState]:
    torch.manual_seed(0)
    model = Frozen()
    opt = torch.optim.AdamW(model.adapter.parameters())
    return model, opt, safepoint.TrainState(model=model, optimizer=opt)


def _manager(root: Path) -> safepoint.CheckpointManager:
    mgr = safepoint.CheckpointManager(
        root,
        keep=safepoint.Keep(last=5),
        async_save=True,
        writer=safepoint.WriterOptions(async_writer="process"),
    )
    assert mgr._process is not None
    mgr._process.wait_ready()  # so that the process writes every save (not the thread while it starts)
    return mgr


def _file_of(root: Path, step: int, fqn: str) -> Path:
    md = read_metadata_file(root / f"step-{step}" / ".metadata")
    names = {info.relative_path for idx, info in md.storage_data.items() if idx.fqn == fqn}
    assert len(names) == 1, names
    return root / f"step-{step}" / names.pop()


def _stats(root: Path, step: int) -> dict[str, int]:
    manifest = json.loads((root / f"step-{step}" / "safepoint.json").read_text())
    return manifest["extra"]["incremental"]  # type: ignore[no-any-return]


def _plain_load(step_dir: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sd = {"model": {k: torch.zeros_like(v) for k, v in like.items()}}
    dcp.load(sd, checkpoint_id=str(step_dir))
    return sd["model"]


def test_the_writer_process_writes_only_what_changed(root: Path, tmp_path: Path) -> None:
    model, opt, state = _setup()
    with _manager(root) as mgr:
        for step in range(1, 5):
            model.step(opt)
            mgr.save(step, state)
            mgr.wait()
        assert mgr._process is not None
        assert mgr._process.writes == 4 and mgr._process.thread_writes == 0  # the process wrote each
        # Described once (handoff.py): later saves sent their values and their files only.
        assert mgr._process.descriptions == 1 and mgr._process.stale == 0
    base = _file_of(root, 4, "model.base")
    # Written into a stable group at step 2, then the very same inode in steps 3 and 4.
    assert base.stat().st_ino == _file_of(root, 3, "model.base").stat().st_ino
    assert base.stat().st_ino == _file_of(root, 2, "model.base").stat().st_ino
    assert base.stat().st_nlink == 3
    assert _file_of(root, 4, "model.table").stat().st_ino == _file_of(root, 3, "model.table").stat().st_ino
    adapter = _file_of(root, 4, "model.adapter.weight")
    assert adapter.stat().st_nlink == 1 and adapter != base
    stats = _stats(root, 4)
    assert stats["linked"] >= FROZEN * 4 * 5 // 4 and stats["written"] == 0
    assert _stats(root, 1)["linked"] == 0
    assert main(["verify", str(root), "--all"]) == 0
    # Step 4 alone, elsewhere: plain DCP restores it bit for bit, and so does safepoint.
    alone = tmp_path / "elsewhere"
    shutil.copytree(root / "step-4", alone / "step-4")
    shutil.rmtree(root)
    loaded = _plain_load(alone / "step-4", model.state_dict())
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    torch.manual_seed(7)
    fresh = Frozen()
    fresh_opt = torch.optim.AdamW(fresh.adapter.parameters())
    with safepoint.CheckpointManager(alone) as again:
        assert again.restore(safepoint.TrainState(model=fresh, optimizer=fresh_opt)) == 4
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    assert fresh_opt.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])


def _bypass_data(t: torch.Tensor) -> None:
    t.data[123] += 1.0


def _bypass_numpy(t: torch.Tensor) -> None:
    t.detach().numpy()[123] += 1.0


# .data under -m slow (time bar): tests/store/test_incremental.py runs every bypass through the writer thread
@pytest.mark.parametrize(
    "bypass", [pytest.param(_bypass_data, marks=pytest.mark.slow), _bypass_numpy], ids=["data", "numpy"]
)
def test_a_write_the_version_counter_misses_is_rewritten(root: Path, bypass: object) -> None:
    model, opt, state = _setup()
    with _manager(root) as mgr:
        for step in (1, 2, 3):
            model.step(opt)
            mgr.save(step, state)
            mgr.wait()
        version = model.base._version
        bypass(model.base)  # type: ignore[operator]
        assert model.base._version == version  # the counter did not see it
        mgr.save(4, state)
        mgr.wait()
    assert _file_of(root, 4, "model.base").stat().st_nlink == 1
    assert _file_of(root, 4, "model.base").stat().st_ino != _file_of(root, 3, "model.base").stat().st_ino
    # Its stable group (with the unchanged buffer) was written again, not linked.
    assert _stats(root, 4)["written"] >= FROZEN and _stats(root, 4)["linked"] == 0
    loaded = _plain_load(root / "step-4", model.state_dict())
    assert torch.equal(loaded["base"], model.base) and not torch.equal(
        _plain_load(root / "step-3", model.state_dict())["base"], model.base
    )


def _wait_for_link(root: Path, step: int, timeout_s: float = 120.0) -> None:
    """Until the save of ``step`` has hard-linked a file into its pending directory."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for f in (root / ".pending").glob(f"step-{step}-*/__*.distcp"):
            if f.stat().st_nlink >= 2:
                return
        time.sleep(0.002)
    raise AssertionError(f"the save of step {step} linked nothing")


def test_kill_9_of_the_writer_process_mid_save_leaves_the_older_steps_intact(root: Path) -> None:
    """The writer process is stopped, then SIGKILLed once the rank has linked the unchanged groups into
    the new step (the save is then mid-way: links made, nothing written). That save fails; the steps whose
    files it linked still verify and restore bit for bit; the next save (a new process) links again."""
    model, opt, state = _setup()
    with _manager(root) as mgr:
        for step in (1, 2, 3):
            model.step(opt)
            mgr.save(step, state)
            mgr.wait()
        at3 = {k: v.clone() for k, v in model.state_dict().items()}
        assert mgr._process is not None and mgr._process.pid is not None
        pid = mgr._process.pid
        os.kill(pid, signal.SIGSTOP)  # it cannot take step 4's files before it dies
        try:
            model.step(opt)
            mgr.save(4, state)
            _wait_for_link(root, 4)
        finally:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(safepoint.SaveError, match="save of step 4 failed and was not committed"):
            mgr.wait()
        assert [c.step for c in mgr.list()] == [1, 2, 3]
        mgr._process.wait_ready()
        mgr.save(5, state)
        mgr.wait()
        assert mgr._process.started == 2
    assert not list((root / ".pending").iterdir())
    assert _file_of(root, 5, "model.base").stat().st_ino == _file_of(root, 3, "model.base").stat().st_ino
    assert main(["verify", str(root), "--all"]) == 0
    for step, want in ((3, at3), (5, model.state_dict())):
        loaded = _plain_load(root / f"step-{step}", model.state_dict())
        assert all(torch.equal(loaded[k], v) for k, v in want.items()), step
