"""The file of a save's non-tensor items (store/byte_file.py) is hard-linked from the previous step only
while every item pickles as the previous step's file holds it; anything else writes it anew, and every
step restores exactly and stays readable by plain DCP. Also: a link of a file whose identity is known
never opens it (store/links.py), and a file swapped in is never kept."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import safepoint
from safepoint.store import links
from safepoint.store.rootfs import RootDir
from safepoint.store.storage import read_metadata_file


class Params(nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w)


def _items_file(root: Path, step: int) -> Path:
    """The file holding the optimizer's lr in ``step``."""
    md = read_metadata_file(root / f"step-{step}" / ".metadata")
    (name,) = {info.relative_path for idx, info in md.storage_data.items() if idx.fqn.endswith(".lr")}
    return root / f"step-{step}" / name


def _restored_lr(root: Path, step: int) -> Any:
    target = Params(torch.zeros(4, 4))
    fresh = torch.optim.SGD(target.parameters(), lr=9.0, momentum=0.1)
    target.w.grad = torch.zeros(4, 4)
    fresh.step()  # a momentum buffer, as the saved optimizer has
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(model=target, optimizer=fresh, rng=False), step=step) == step
    return fresh.param_groups[0]["lr"]


def _plain_weights(root: Path, step: int) -> torch.Tensor:
    sd: dict[str, Any] = {"model": {"w": torch.zeros(4, 4)}}
    dcp.load(sd, checkpoint_id=str(root / f"step-{step}"), no_dist=True)
    return sd["model"]["w"]


def _setup() -> tuple[Params, torch.optim.Optimizer, safepoint.TrainState]:
    model = Params(torch.randn(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model.w.grad = torch.ones(4, 4)
    opt.step()
    return model, opt, safepoint.TrainState(model=model, optimizer=opt, rng=False)


def test_unchanged_items_are_linked_and_a_changed_one_is_written(root: Path) -> None:
    model, opt, state = _setup()
    lrs = [0.5, 0.5, 0.5, 0.25, 0.25, 1, 1.0, 1.0]
    with safepoint.CheckpointManager(root, keep=safepoint.Keep(last=10)) as mgr:
        for step, lr in enumerate(lrs, start=1):
            opt.param_groups[0]["lr"] = lr
            mgr.save(step, state)
    inode = {step: _items_file(root, step).stat().st_ino for step in range(1, len(lrs) + 1)}
    # Step 1's items share a file with its new tensors; from step 2 on they have one of their own, linked
    # where every item pickles as the step before's file holds it (1.0 == 1, but pickles otherwise).
    linked = [step for step in range(2, len(lrs) + 1) if inode[step] == inode[step - 1]]
    assert linked == [3, 5, 8]
    for step, lr in enumerate(lrs, start=1):
        got = _restored_lr(root, step)  # verified against the manifest's crc32c, file by file
        assert got == lr and type(got) is type(lr)
        assert torch.equal(_plain_weights(root, step), model.w.detach())


def test_a_changed_tensor_or_a_full_copy_writes_them_anew(root: Path) -> None:
    model, _, state = _setup()
    with safepoint.CheckpointManager(
        root, keep=safepoint.Keep(last=10), writer=safepoint.WriterOptions(full_every=3)
    ) as mgr:
        for step in range(1, 6):
            if step == 5:
                with torch.no_grad():
                    model.w.add_(1.0)  # the items share their file with the changed tensor
            mgr.save(step, state)
    inode = {step: _items_file(root, step).stat().st_ino for step in range(1, 6)}
    # Steps 1 (new tensors) and 2 write; 3 links 2's; 4 is a physical full copy (full_every=3: saves since
    # the last one); 5 holds a changed tensor.
    assert [inode[s] == inode[s - 1] for s in range(2, 6)] == [False, True, False, False]
    assert _items_file(root, 5).stat().st_nlink == 1
    for step in range(1, 6):
        assert _restored_lr(root, step) == 0.5
    assert torch.equal(_plain_weights(root, 5), model.w.detach())


def test_a_replaced_file_is_never_linked(root: Path) -> None:
    """The previous step's file replaced by a copy (same bytes, another inode), or by a symlink to a file
    outside the root: the next save writes its own, never links or changes the other file."""
    _, _, state = _setup()
    with safepoint.CheckpointManager(root, keep=safepoint.Keep(last=10)) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        old = _items_file(root, 2)
        copy = old.with_name("copy")
        shutil.copyfile(old, copy)
        os.replace(copy, old)
        mgr.save(3, state)
        third = _items_file(root, 3).stat().st_ino
        # Held open while step 4 is saved: an unlinked file's inode number is free for the next file the
        # file system makes (step 4's own, here), and the identity check below would then compare a
        # reused number (it failed once so, on a fresh clone).
        held = os.open(_items_file(root, 3), os.O_RDONLY)
        outside = root.parent / "outside.bin"
        shutil.copyfile(_items_file(root, 3), outside)
        _items_file(root, 3).unlink()
        _items_file(root, 3).symlink_to(outside)
        try:
            mgr.save(4, state)
            new = _items_file(root, 4)
            assert new.stat().st_ino not in (third, outside.stat().st_ino)
        finally:
            os.close(held)
    assert third != old.stat().st_ino
    assert not new.is_symlink() and new.stat().st_nlink == 1 and outside.stat().st_nlink == 1
    assert _restored_lr(root, 4) == 0.5
    assert _restored_lr(root, 2) == 0.5  # the copy put in by hand holds the same bytes


def test_a_file_of_known_identity_is_linked_without_being_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    source = tmp_path / "a" / "f"
    source.write_bytes(b"x" * 100)
    stored = links.StoredFile("f", {}, 100, "0", links.file_identity(os.stat(source)))

    def refused(self: RootDir, rel: object) -> int:
        raise AssertionError("opened")

    monkeypatch.setattr(RootDir, "open_read", refused)
    assert links.link_into(source, tmp_path / "b" / "f", stored) == stored
    assert (tmp_path / "b" / "f").stat().st_ino == source.stat().st_ino
    # Another inode at the name (same bytes, same size): the link is made, found foreign, and removed.
    source.unlink()
    source.write_bytes(b"x" * 100)
    assert links.link_into(source, tmp_path / "b" / "g", stored) is None
    assert not (tmp_path / "b" / "g").exists()
    # A symlink at the name: linked as a link (never followed), found not a regular file, removed.
    source.unlink()
    source.symlink_to(tmp_path / "b" / "f")
    assert links.link_into(source, tmp_path / "b" / "h", stored) is None
    assert not os.path.lexists(tmp_path / "b" / "h")


def test_the_linker_keeps_only_the_recorded_inode(tmp_path: Path) -> None:
    """The save's linker (one descriptor per directory) proves each link as link_into does."""
    (tmp_path / "a").mkdir()
    source = tmp_path / "a" / "f"
    source.write_bytes(b"x" * 100)
    stored = links.StoredFile("f", {}, 100, "0", links.file_identity(os.stat(source)))
    (tmp_path / "b").mkdir()
    with links.Linker(tmp_path / "a", tmp_path / "b") as linker:
        assert linker.link(stored) == stored
    assert (tmp_path / "b" / "f").stat().st_ino == source.stat().st_ino
    source.unlink()
    source.write_bytes(b"x" * 100)  # another inode, same name and size
    (tmp_path / "c").mkdir()
    with links.Linker(tmp_path / "a", tmp_path / "c") as linker:
        assert linker.link(stored) is None
    source.unlink()
    source.symlink_to(tmp_path / "b" / "f")  # a symlink to the very inode: never followed
    with links.Linker(tmp_path / "a", tmp_path / "c") as linker:
        assert linker.link(stored) is None
    assert os.listdir(tmp_path / "c") == []
    # The source directory swapped for a symlink to one holding the inode: the walk refuses it.
    shutil.rmtree(tmp_path / "a")
    (tmp_path / "a").symlink_to(tmp_path / "b")
    with links.Linker(tmp_path / "a", tmp_path / "c") as linker:
        assert linker.link(stored) is None
    assert os.listdir(tmp_path / "c") == []


def test_the_side_file_is_json_dumps_and_a_steady_save_reuses_its_parts(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rank-0.fingerprints (store/incremental_record.encode) is json.dumps of its body, byte for byte; a
    save whose fingerprints and stable groups are its previous save's dumps neither again."""
    import json

    from safepoint.store import incremental_record

    dumped: list[object] = []
    real = json.dumps

    def counting(o: Any, **k: Any) -> str:
        if not (isinstance(o, dict) and "format" in o):  # not a manifest (json is one module for all)
            dumped.append(o)
        return real(o, **k)

    monkeypatch.setattr(incremental_record.json, "dumps", counting)
    model, _, state = _setup()
    calls = []
    with safepoint.CheckpointManager(root, keep=safepoint.Keep(last=10)) as mgr:
        for step in range(1, 6):
            if step == 4:
                with torch.no_grad():
                    model.w.add_(1.0)
            dumped.clear()
            mgr.save(step, state)
            calls.append(len(dumped))
            data = (root / f"step-{step}" / "rank-0.fingerprints").read_bytes()
            assert data == real(json.loads(data), separators=(",", ":")).encode()
    # 1: both parts; 2: the stable groups are new; 3: both as at 2; 4: a tensor changed (its fingerprint,
    # and it leaves its group); 5: the changed tensor's new fingerprint proves it unchanged and groups it.
    assert calls == [2, 1, 0, 2, 1]
