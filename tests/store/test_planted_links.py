"""The commit protocol, DCP's writer and the rank files create every file through store/rootfs.py: a
symlink planted at a name a save is about to write (in ``.pending/<save>/``, which another process sharing
the root can write) is unlinked, never written through. On main before issue 23's move, each of these
wrote (or truncated) the file outside the root the link pointed at."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import safepoint
from safepoint.state import rank_key
from safepoint.store import rank_state
from safepoint.store.manifest import MANIFEST_NAME
from safepoint.store.posix_layout import Layout
from safepoint.store.reader import SafeReader
from safepoint.store.rootfs import RootDir
from safepoint.store.storage import SafepointWriter

PRECIOUS = b"someone else's file\n"


def _outside(tmp_path: Path) -> Path:
    victim = tmp_path / "elsewhere" / "victim"
    victim.parent.mkdir()
    victim.write_bytes(PRECIOUS)
    return victim


def _saved(root: Path) -> Layout:
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, safepoint.TrainState(rng=False, extra={"t": torch.arange(8.0)}))
    return Layout(root)


def test_a_link_planted_at_the_manifest_name_is_not_written_through(tmp_path: Path) -> None:
    victim, layout = _outside(tmp_path), _saved(tmp_path / "root")
    manifest = layout.read_manifest(1)
    pending = layout.new_pending(1, "again")
    shutil.copytree(layout.step_path(1), pending)
    (pending / MANIFEST_NAME).unlink()
    (pending / MANIFEST_NAME).symlink_to(victim)
    layout.commit(pending, manifest)  # replaces step-1 (renameat2 exchange between walked directories)
    assert victim.read_bytes() == PRECIOUS
    assert not (layout.step_path(1) / MANIFEST_NAME).is_symlink()
    assert layout.verify(1).step == 1


@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
def test_links_planted_at_dcps_file_names_are_not_written_through(tmp_path: Path) -> None:
    victim = _outside(tmp_path)
    save = tmp_path / "root" / ".pending" / "step-1-x"
    save.mkdir(parents=True)
    # The names the writer creates (.metadata is written in place, no .metadata.tmp: store/storage.py).
    for name in ("__0_0.distcp", ".metadata"):
        (save / name).symlink_to(victim)
    dcp.save({"t": torch.arange(8.0)}, storage_writer=SafepointWriter(save), no_dist=True)
    assert victim.read_bytes() == PRECIOUS
    assert not any(p.is_symlink() for p in save.iterdir())
    assert {"__0_0.distcp", ".metadata"} <= {p.name for p in save.iterdir()}


def test_dcps_writer_refuses_a_symlinked_pending(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / ".pending").symlink_to(elsewhere)
    try:
        dcp.save(
            {"t": torch.arange(8.0)},
            storage_writer=SafepointWriter(tmp_path / "root/.pending/s"),
            no_dist=True,
        )
    except BaseException as e:  # DCP wraps the OSError in its CheckpointException (a BaseException)
        assert "symlink" in str(e), e
    else:
        raise AssertionError("saved through a symlinked .pending")
    assert list(elsewhere.iterdir()) == []


def test_a_link_planted_at_a_rank_file_name_is_not_written_through(tmp_path: Path) -> None:
    victim, layout = _outside(tmp_path), Layout(tmp_path / "root")
    layout.ensure_root()
    pending = layout.new_pending(1, "x")
    pending.mkdir()
    (pending / rank_state.file_name(0)).symlink_to(victim)
    written = rank_state.write(layout, pending, 0, {"extra": {rank_key(0): {"t": 1}}})
    assert victim.read_bytes() == PRECIOUS
    assert not (pending / rank_state.file_name(0)).is_symlink()
    assert written[rank_state.file_name(0)][0] == (pending / rank_state.file_name(0)).stat().st_size


def test_the_reader_never_reads_through_a_step_directory_swapped_for_a_symlink(tmp_path: Path) -> None:
    """SafeReader opens every file (and ``.metadata``) walking from the root: a step directory swapped
    for a link to a copy elsewhere after it was listed is refused (O_NOFOLLOW|O_DIRECTORY: ENOTDIR), not read from there."""
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    dcp.save({"t": torch.arange(8.0)}, storage_writer=SafepointWriter(root / "step-1"), no_dist=True)
    shutil.move(root / "step-1", elsewhere)
    (root / "step-1").symlink_to(elsewhere)
    out = {"t": torch.zeros(8)}
    with pytest.raises(BaseException, match="Not a directory: .step-1."):
        dcp.load(out, storage_reader=SafeReader(root / "step-1", root=RootDir(root)), no_dist=True)
    assert torch.equal(out["t"], torch.zeros(8))
    ok = {"t": torch.zeros(8)}  # the same files, reached without a link: read
    dcp.load(ok, storage_reader=SafeReader(elsewhere, root=RootDir(tmp_path)), no_dist=True)
    assert torch.equal(ok["t"], torch.arange(8.0))
