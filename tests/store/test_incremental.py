"""Incremental saves (store/incremental.py): unchanged tensors are linked, never stale, every step complete."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import safepoint
from safepoint.cli.main import main
from safepoint.store.storage import read_metadata_file
from tests.helpers.example_runs import run_job, spawn_job

VOCAB, DIM = 512, 64


class Tied(nn.Module):
    """A frozen embedding table, a trainable layer, and an output head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.emb.weight.requires_grad_(False)
        self.mid = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: two keys, one tensor
        self.register_buffer("table", torch.randn(VOCAB, DIM))  # a frozen buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.emb(x)))


def _train(model: Tied, opt: torch.optim.Optimizer) -> None:
    model(torch.randint(0, VOCAB, (8,))).sum().backward()
    opt.step()
    opt.zero_grad()


def _manifest(root: Path, step: int) -> dict:  # type: ignore[type-arg]
    return json.loads((root / f"step-{step}" / "safepoint.json").read_text())


def _file_of(root: Path, step: int, fqn: str) -> Path:
    md = read_metadata_file(root / f"step-{step}" / ".metadata")
    names = {info.relative_path for idx, info in md.storage_data.items() if idx.fqn == fqn}
    assert len(names) == 1
    return root / f"step-{step}" / names.pop()


def _plain_load(step_dir: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sd = {"model": {k: torch.zeros_like(v) for k, v in like.items()}}
    dcp.load(sd, checkpoint_id=str(step_dir))
    return sd["model"]


def _saves(root: Path, steps: int, **writer: object) -> tuple[Tied, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    state = safepoint.TrainState(model=model, optimizer=opt)
    with safepoint.CheckpointManager(
        root, save_every_steps=1, keep=safepoint.Keep(last=3), writer=safepoint.WriterOptions(**writer)
    ) as mgr:
        for step in range(1, steps + 1):
            _train(model, opt)
            mgr.maybe_save(step, state)
    return model, opt


def test_unchanged_tensors_are_linked_and_every_step_is_complete(tmp_path: Path) -> None:
    root = tmp_path / "root"
    model, _ = _saves(root, 4)
    emb = _file_of(root, 4, "model.emb.weight")
    # Steps 3 and 4 hold the frozen tensors' file itself (one inode), written at step 2.
    assert emb.stat().st_ino == _file_of(root, 3, "model.emb.weight").stat().st_ino
    assert emb.stat().st_nlink >= 2
    assert _file_of(root, 4, "model.table") == emb or _file_of(root, 4, "model.table").stat().st_nlink >= 2
    # ... while the trained layer is written every time, to a file of its own.
    mid = _file_of(root, 4, "model.mid.weight")
    assert mid.stat().st_nlink == 1 and mid.name != emb.name
    stats = _manifest(root, 4)["extra"]["incremental"]
    assert stats["linked"] >= 2 * VOCAB * DIM * 4 and stats["written"] == 0
    # Each step is a plain DCP checkpoint, complete on its own: copied alone it loads bit for bit.
    alone = tmp_path / "elsewhere" / "step-4"
    shutil.copytree(root / "step-4", alone)
    shutil.rmtree(root)
    loaded = _plain_load(alone, model.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(loaded[k], v), k


def test_tied_weights_are_written_once(tmp_path: Path) -> None:
    root = tmp_path / "root"
    model, _ = _saves(root, 1)
    md = read_metadata_file(root / "step-1" / ".metadata")
    where = {idx.fqn: info for idx, info in md.storage_data.items()}
    emb, head = where["model.emb.weight"], where["model.head.weight"]
    assert (emb.relative_path, emb.offset, emb.length) == (head.relative_path, head.offset, head.length)
    assert _manifest(root, 1)["extra"]["incremental"]["aliased"] == 1
    # verify (which checks every item's bytes) takes two keys of one stored item as intact.
    assert main(["verify", str(root)]) == 0
    # Both keys load (plain DCP and safepoint), and stay tied in safepoint's restore.
    loaded = _plain_load(root / "step-1", model.state_dict())
    assert torch.equal(loaded["head.weight"], model.emb.weight)
    torch.manual_seed(5)
    fresh = Tied()
    opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad])
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(model=fresh, optimizer=opt)) == 1
    assert torch.equal(fresh.emb.weight, model.emb.weight) and fresh.head.weight is fresh.emb.weight


def _bypass_data(t: torch.Tensor) -> None:
    t.data.add_(1.0)


def _bypass_numpy(t: torch.Tensor) -> None:
    t.detach().numpy()[...] += 1.0


def _bypass_dlpack(t: torch.Tensor) -> None:
    np.from_dlpack(t.detach())[...] += 1.0  # type: ignore[index]


def _bypass_no_grad(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.mul_(2.0).add_(1.0)


def _bypass_collective(t: torch.Tensor) -> None:
    # A real gloo collective from another process writes into this tensor's memory.
    import torch.distributed as dist

    store_dir = _TMP[0] / f"store-{os.getpid()}"
    # The peer rank is forked from the suite's fork server (a fresh interpreter is not the subject).
    peer = spawn_job(["-c", _PEER, str(store_dir), str(t.numel())], 1, 2)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_dir}", rank=0, world_size=2)
        try:
            dist.broadcast(t.detach(), src=1)
        finally:
            dist.destroy_process_group()
        assert peer.wait(timeout=120) == 0
    finally:
        if peer.returncode is None:
            os.killpg(peer.pid, signal.SIGKILL)
            peer.wait()


_TMP: list[Path] = []  # the running test's tmp_path (below)

_PEER = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=1, world_size=2)
dist.broadcast(torch.full((int(sys.argv[2]),), 7.0).reshape(-1), src=1)
dist.destroy_process_group()
"""


def _path() -> str:
    return os.pathsep.join(p for p in sys.path if p)


@pytest.mark.parametrize(
    "bypass",
    [_bypass_data, _bypass_numpy, _bypass_dlpack, _bypass_no_grad, _bypass_collective],
    ids=["data", "numpy", "dlpack", "no_grad", "gloo_broadcast"],
)
def test_a_write_the_version_counter_misses_is_still_saved(
    tmp_path: Path, bypass: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The test's directory for the collective's rendezvous file: not an environment variable, which would
    # key a fork server of its own for the peer (tests/helpers/forkserver.py: ~5 s of CPU).
    monkeypatch.setattr(sys.modules[__name__], "_TMP", [tmp_path])
    root = tmp_path / "root"
    torch.manual_seed(0)
    holder = Holder(torch.randn(256 * 64))
    frozen = holder.frozen
    state = safepoint.TrainState(model=holder)
    with safepoint.CheckpointManager(root, keep=safepoint.Keep(last=5)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state)
        before = _file_of_extra(root, 3)
        assert before.stat().st_nlink >= 2, "the unchanged tensor must be linked by step 3"
        version = frozen._version
        bypass(frozen)  # type: ignore[operator]
        expected = frozen.detach().clone()
        mgr.save(4, state)
    if bypass is not _bypass_no_grad:
        assert frozen._version == version, "not a bypass of the version counter"
    assert not torch.equal(expected, _read_extra(root, 3, frozen))
    assert torch.equal(_read_extra(root, 4, frozen), expected), "a stale tensor was saved"
    fresh = Holder(torch.zeros(256 * 64))
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(model=fresh)) == 4
    assert torch.equal(fresh.frozen, expected)


class Holder(nn.Module):
    """A frozen 1-D parameter (what the bypasses write into) and a small one."""

    def __init__(self, frozen: torch.Tensor) -> None:
        super().__init__()
        self.frozen = nn.Parameter(frozen, requires_grad=False)
        self.moving = nn.Parameter(torch.zeros(10))


def _file_of_extra(root: Path, step: int) -> Path:
    md = read_metadata_file(root / f"step-{step}" / ".metadata")
    (name,) = {info.relative_path for idx, info in md.storage_data.items() if "frozen" in idx.fqn}
    return root / f"step-{step}" / name


def _read_extra(root: Path, step: int, like: torch.Tensor) -> torch.Tensor:
    md = read_metadata_file(root / f"step-{step}" / ".metadata")
    (fqn,) = {idx.fqn for idx in md.storage_data if "frozen" in idx.fqn}
    sd = {fqn: torch.zeros(like.numel())}
    dcp.load(sd, checkpoint_id=str(root / f"step-{step}"))
    return sd[fqn].view_as(like.detach())


def test_a_planted_symlink_is_never_linked(tmp_path: Path) -> None:
    """The previous step's stable file replaced by a symlink to a file outside the root (same bytes): the
    next save writes its own copy and never links, reads or changes the outside file."""
    root = tmp_path / "root"
    torch.manual_seed(0)
    holder = Holder(torch.randn(1000))
    state = safepoint.TrainState(model=holder)
    with safepoint.CheckpointManager(root, keep=safepoint.Keep(last=5)) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        stable = _file_of_extra(root, 2)
        outside = tmp_path / "outside.bin"
        shutil.copyfile(stable, outside)
        stable.unlink()
        stable.symlink_to(outside)
        mgr.save(3, state)
    new = _file_of_extra(root, 3)
    assert not new.is_symlink() and new.stat().st_ino != outside.stat().st_ino
    assert outside.stat().st_nlink == 1
    assert torch.equal(_read_extra(root, 3, holder.frozen), holder.frozen)


def test_the_previous_step_gone_means_written_again(tmp_path: Path) -> None:
    root = tmp_path / "root"
    holder = Holder(torch.arange(1000.0))
    state = safepoint.TrainState(model=holder)
    with safepoint.CheckpointManager(root, keep=safepoint.Keep(last=5)) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        shutil.rmtree(root / "step-2")  # deleted behind the manager's back
        mgr.save(3, state)
    assert _file_of_extra(root, 3).stat().st_nlink == 1
    assert torch.equal(_read_extra(root, 3, holder.frozen), holder.frozen)


def test_a_damaged_shared_file_leaves_an_older_intact_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """full_every=3, keep_last=3: one flipped byte in the newest step's largest shared file damages every
    step holding that inode; retention kept a step sharing nothing with the newest, restore falls back to
    it, and verify names every step that shares the damaged file."""
    root = tmp_path / "root"
    _saves(root, 8, full_every=3)
    steps = sorted(int(p.name[5:]) for p in root.glob("step-*"))
    newest = max(steps)
    largest = max((root / f"step-{newest}").glob("*.distcp"), key=lambda p: p.stat().st_size)
    assert largest.stat().st_nlink >= 2
    sharing = sorted(
        s for s in steps if any(f.samefile(largest) for f in (root / f"step-{s}").glob("*.distcp"))
    )
    assert len(sharing) >= 2 and len(sharing) < len(steps)
    with open(largest, "r+b") as f:
        f.seek(largest.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    capsys.readouterr()
    assert main(["verify", str(root), "--all"]) == 1  # in-process: the CLI's process boundary is tests/cli's
    out = capsys.readouterr().out
    for s in sharing:
        assert f"step {s}" in out
    assert f"in step {sharing[0]}" in out or f"step {sharing[0]}," in out
    fresh = Tied()
    opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad])
    with pytest.warns(UserWarning), safepoint.CheckpointManager(root) as mgr:
        got = mgr.restore(safepoint.TrainState(model=fresh, optimizer=opt))
    assert got not in sharing and got > 0


def test_incremental_off_writes_everything(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _saves(root, 3, incremental=False)
    assert all(p.stat().st_nlink == 1 for p in root.glob("step-*/*"))
    assert "incremental" not in _manifest(root, 3)["extra"]


def test_writer_options_validate() -> None:
    with pytest.raises(ValueError, match="full_every"):
        safepoint.WriterOptions(full_every=-1)
    with pytest.raises(ValueError, match="incremental"):
        safepoint.WriterOptions(incremental=1)  # type: ignore[arg-type]


def test_async_saves_link_too(tmp_path: Path) -> None:
    """Staged copies (async, the writer thread): the fingerprint decides, not the staging buffers'
    version counters (which move at every copy)."""
    root = tmp_path / "root"
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    state = safepoint.TrainState(model=model, optimizer=opt)
    # "wait": every save is an async one (the default, "auto", writes a save that finds the previous one
    # still writing synchronously, and which saves those are depends on timing).
    writer = safepoint.WriterOptions(async_writer="thread", if_busy="wait")
    with safepoint.CheckpointManager(
        root, keep=safepoint.Keep(last=3), async_save=True, writer=writer
    ) as mgr:
        for step in range(1, 5):
            _train(model, opt)
            mgr.save(step, state)
        mgr.wait()
    assert _file_of(root, 4, "model.emb.weight").stat().st_nlink >= 2
    loaded = _plain_load(root / "step-4", model.state_dict())
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def test_kill_while_linking_leaves_the_older_steps_intact(tmp_path: Path) -> None:
    """A real SIGKILL in the middle of linking (the third save): that save is never listed, the next
    owner removes it, and the steps whose files it had linked still verify and restore."""
    root = tmp_path / "root"
    script = f"""
import os, signal, torch, safepoint, safepoint.store.incremental as inc
torch.manual_seed(0)
m = torch.nn.Module()
m.frozen = torch.nn.Parameter(torch.randn(4096), requires_grad=False)
m.moving = torch.nn.Parameter(torch.zeros(8))
real = os.link
def link(src, dst, **kw):
    real(src, dst, **kw)
    os.kill(os.getpid(), signal.SIGKILL)  # the link is made: die before the save goes on
with safepoint.CheckpointManager({str(root)!r}, keep=safepoint.Keep(last=5)) as mgr:
    st = safepoint.TrainState(model=m)
    for step in (1, 2):
        with torch.no_grad():
            m.moving.add_(1)
        mgr.save(step, st)
    inc.os.link = link
    mgr.save(3, st)
"""
    proc = run_job(["-c", script], timeout=300)  # forked from the suite's fork server: a kill, not a start
    assert proc.returncode == -9, proc.stderr[-3000:]
    pending = list((root / ".pending").iterdir())
    assert pending and any(p.stat().st_nlink == 2 for d in pending for p in d.iterdir())
    assert main(["verify", str(root), "--all"]) == 0
    torch.manual_seed(0)
    frozen = torch.randn(4096)
    fresh = Holder(torch.zeros(4096))
    fresh.moving = nn.Parameter(torch.zeros(8))
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(model=fresh)) == 2
    assert not list((root / ".pending").iterdir())
    assert torch.equal(fresh.frozen, frozen) and torch.all(fresh.moving == 2)
    assert all(p.stat().st_nlink == 1 for p in (root / "step-2").iterdir())
