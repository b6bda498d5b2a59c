"""The guarded walk (store/rootfs.py): no symlink below the root is followed, wherever it stands in a path;
only regular files are read, and never without bound; creates never write through a planted link; deletes
never leave the root. Real symlinks, FIFOs and directories."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from safepoint.store.guard import NotRegularFileError
from safepoint.store.rootfs import OutsideRootError, RootDir


@pytest.fixture
def hostile(tmp_path: Path) -> tuple[RootDir, Path]:
    """A root whose ``.peers`` and ``.pending`` are symlinks to a directory outside it, holding files and
    subdirectories (one named like a step), and whose ``step-1`` holds a FIFO and a link to a file outside."""
    outside = tmp_path / "outside"
    (outside / "step-1").mkdir(parents=True)
    (outside / "step-1" / "keep.txt").write_text("not ours")
    (outside / "secret").write_text("not ours")
    root = tmp_path / "root"
    (root / "step-1").mkdir(parents=True)
    (root / "step-1" / "data").write_bytes(b"0123456789")
    os.mkfifo(root / "step-1" / "fifo")
    (root / "step-1" / "link").symlink_to(outside / "secret")
    (root / ".peers").symlink_to(outside)
    (root / ".pending").symlink_to(outside)
    return RootDir(root), outside


def _tree(path: Path) -> list[tuple[str, str]]:
    return sorted(
        (str(p.relative_to(path)), p.read_text() if p.is_file() else "")
        for p in path.rglob("*")
        if not p.is_symlink()
    )


def test_no_component_below_the_root_is_followed(hostile: tuple[RootDir, Path]) -> None:
    fs, outside = hostile
    before = _tree(outside)
    assert not fs.isdir(".peers") and fs.kind(".peers") == "a symlink"
    assert not fs.lexists(".peers/step-1") and not fs.isfile(".peers/secret")  # under the link: nothing
    with pytest.raises(OSError) as e:
        fs.read(".peers/secret", 100)
    assert e.value.errno in (errno.ELOOP, errno.ENOTDIR)  # O_DIRECTORY|O_NOFOLLOW on a link: ENOTDIR
    with pytest.raises(OSError):
        fs.listdir(".peers")
    with pytest.raises(OSError):
        fs.create(".pending/new", parents=True)
    with pytest.raises(OSError):
        fs.makedirs(".pending/x")
    with pytest.raises(OSError):
        fs.move("step-1/data", ".pending/data")
    assert fs.remove_tree(".peers/step-1") is not None  # a link on the way: left alone, said
    assert fs.remove_tree(".pending") is None  # the link itself is ours to remove; its target is not
    assert not (fs.path / ".pending").is_symlink() and (fs.path / ".peers").is_symlink()
    assert _tree(outside) == before


def test_only_bounded_regular_files_are_read(hostile: tuple[RootDir, Path]) -> None:
    fs, _ = hostile
    assert fs.read("step-1/data", 10) == b"0123456789"
    with pytest.raises(OSError) as e:
        fs.read("step-1/data", 9)
    assert e.value.errno == errno.EFBIG
    with pytest.raises(NotRegularFileError, match="a FIFO"):  # returns at once: never blocks
        fs.read("step-1/fifo", 100)
    with pytest.raises(OSError):
        fs.read("step-1/link", 100)
    assert fs.crc32c("step-1/data")[0] == 10
    assert fs.isfile("step-1/data") and not fs.isfile("step-1/fifo") and not fs.isfile("step-1/link")


def test_a_create_replaces_a_planted_link_and_never_writes_through_it(hostile: tuple[RootDir, Path]) -> None:
    fs, outside = hostile
    fs.write("step-1/link", b"ours")
    assert (outside / "secret").read_text() == "not ours"
    assert not (fs.path / "step-1" / "link").is_symlink() and fs.read("step-1/link", 10) == b"ours"
    fs.move("step-1/link", "step-1/moved")
    assert fs.listdir("step-1") == ["data", "fifo", "moved"]
    fs.makedirs("a/b/c")
    assert fs.isdir("a/b/c")
    assert fs.remove_tree("a") is None and not fs.lexists("a")


def test_paths_outside_the_root_are_refused(hostile: tuple[RootDir, Path], tmp_path: Path) -> None:
    fs, _ = hostile
    for bad in ("../outside", "step-1/../../outside", "/etc/passwd"):
        with pytest.raises(OutsideRootError):
            fs.read(bad, 10)
    with pytest.raises(OutsideRootError):
        fs.read(tmp_path / "outside" / "secret", 10)
    assert fs.read(fs.path / "step-1" / "data", 10) == b"0123456789"  # a Path under the root is fine


def test_dirs_holding_answers_as_a_walk_per_name_would(tmp_path: Path) -> None:
    """Retention's listing (Layout.committed_steps) from one descriptor of the root: the same names as
    ``isdir(name) and isfile(name/manifest)``, so a symlinked step, a step whose manifest is a link, a FIFO or
    a directory, and a file named like a step are never listed; names not wanted are not looked into."""
    outside = tmp_path / "outside"
    (outside / "step-9").mkdir(parents=True)
    (outside / "step-9" / "m").write_text("{}")
    root = tmp_path / "root"
    for name in ("step-1", "step-2", "step-5", "step-6", "step-7", "other"):
        (root / name).mkdir(parents=True)
    (root / "step-1" / "m").write_text("{}")  # the only checkpoint
    (root / "other" / "m").write_text("{}")  # holds one, but is not wanted
    (root / "step-3").symlink_to(outside / "step-9")  # a symlinked step holding a real manifest
    (root / "step-4").write_text("a file named like a step")
    (root / "step-5" / "m").symlink_to(outside / "step-9" / "m")
    os.mkfifo(root / "step-6" / "m")
    (root / "step-7" / "m").mkdir()
    fs = RootDir(root)

    def wanted(name: str) -> bool:
        return name.startswith("step-")

    listed = fs.dirs_holding("m", wanted)
    assert listed == ["step-1"]
    assert listed == [n for n in fs.listdir() if wanted(n) and fs.isdir(n) and fs.isfile(f"{n}/m")]
    assert RootDir(tmp_path / "missing").dirs_holding("m", wanted) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_dirs_holding_raises_what_the_walk_raised(tmp_path: Path) -> None:
    """An unreadable step directory is an error, as it was when each step was walked into, not a step
    silently left out of retention's view."""
    (tmp_path / "step-1").mkdir()
    (tmp_path / "step-1").chmod(0)
    try:
        with pytest.raises(PermissionError):
            RootDir(tmp_path).dirs_holding("m", lambda name: True)
    finally:
        (tmp_path / "step-1").chmod(0o755)


def test_a_flat_step_is_deleted_entry_by_entry_and_its_links_never_followed(
    hostile: tuple[RootDir, Path],
) -> None:
    """``remove_tree`` of a directory without subdirectories unlinks each entry from a descriptor of it
    (guard.remove_flat): a FIFO and a symlink inside go, the symlink's target stays; one with a
    subdirectory (remove_flat gives up at it) is finished by rmtree, a link inside it still not followed."""
    fs, outside = hostile
    before = _tree(outside)
    assert fs.remove_tree("step-1") is None and not fs.lexists("step-1")
    fs.makedirs("step-2/sub")
    fs.write("step-2/a", b"1")
    fs.write("step-2/sub/b", b"2")
    (fs.path / "step-2" / "sub" / "out").symlink_to(outside)
    assert fs.remove_tree("step-2") is None and not fs.lexists("step-2")
    assert _tree(outside) == before


def test_a_create_over_each_kind_of_entry_is_as_before(hostile: tuple[RootDir, Path]) -> None:
    """The create tries O_EXCL first: nothing there, it is made at once; a file or a symlink there is
    unlinked (never written through), a directory refused, FileExistsError when ``exclusive``."""
    fs, outside = hostile
    fs.write("step-1/new", b"n")
    fs.write("step-1/data", b"replaced")
    fs.write("step-1/fifo", b"no fifo now")
    assert fs.read("step-1/new", 10) == b"n" and fs.read("step-1/data", 10) == b"replaced"
    assert fs.read("step-1/fifo", 20) == b"no fifo now" and (outside / "secret").read_text() == "not ours"
    fs.makedirs("step-1/dir")
    with pytest.raises(IsADirectoryError):
        fs.create("step-1/dir")
    with pytest.raises(FileExistsError):
        fs.create("step-1/new", exclusive=True)
