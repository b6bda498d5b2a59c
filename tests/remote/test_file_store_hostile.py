"""A path (or ``file://``) durable root is served by fsspec's local file system, which follows symlinks: a
``step-N``, ``.pending`` or ``.run`` planted below the root as a symlink had the save write the checkpoint
(or the run journal) into its target, outside the root, and retention delete the target's files. Every
write and delete of such a root now walks its directories (store/rootfs.py, ``ObjectStore.guard``), as the
local tier always did: nothing outside the root is written or deleted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import safepoint
from safepoint.remote.open import open_store
from safepoint.remote.retry import UploadError


def _outside(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"not safepoint's")
    return outside


@pytest.mark.parametrize("name", ["step-2", ".run"])
def test_a_planted_symlink_below_a_path_durable_root_is_never_written_through(
    tmp_path: Path, name: str
) -> None:
    durable, outside = tmp_path / "durable", _outside(tmp_path)
    durable.mkdir()
    (durable / name).symlink_to(outside, target_is_directory=True)
    state = safepoint.TrainState(model=torch.nn.Linear(8, 8), rng=False)
    with safepoint.CheckpointManager(durable, local_root=tmp_path / "local") as mgr:
        for step in (1, 2, 3):
            try:
                mgr.save(step, state)
                mgr.wait()
            except safepoint.CheckpointError as e:
                assert step == 2 and name == "step-2", e  # its upload refused, one line, nothing committed
                assert "\n" not in str(e)
                assert f"{durable}/step-2/" in str(e) and "a symlink" in str(e), (
                    e
                )  # not "Not a directory: 'step-2'"
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]
    assert (outside / "victim").read_bytes() == b"not safepoint's"
    with safepoint.CheckpointManager(durable) as mgr:
        assert 3 in [c.step for c in mgr.list()]


def test_the_store_never_deletes_or_copies_through_a_planted_symlink(tmp_path: Path) -> None:
    # What retention and an incremental save ask of the store: delete a step's objects, copy an unchanged
    # one into the next step. Through a step that is a symlink, both reached the target's files.
    durable, outside = tmp_path / "durable", _outside(tmp_path)
    (durable / "step-1").mkdir(parents=True)
    (durable / "step-1" / "a.distcp").write_bytes(b"data")
    (durable / "step-2").symlink_to(outside, target_is_directory=True)
    store, base = open_store(str(durable), None, None)
    store.delete([f"{base}/step-2/victim"])
    with pytest.raises(UploadError):
        store.copy(f"{base}/step-1/a.distcp", f"{base}/step-2/a.distcp")
    with pytest.raises(UploadError):
        store.put_bytes(f"{base}/step-2/safepoint.json", b"{}")
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]
    assert (durable / "step-1" / "a.distcp").read_bytes() == b"data"


def test_the_store_never_reads_through_a_planted_symlink_or_a_fifo(tmp_path: Path) -> None:
    # What a restore from the durable tier asks of the store: the manifest's bytes, each file's size and
    # crc32c, and each file downloaded into the local root. A file of step-1 planted as a symlink was read
    # from outside the root (to /dev/zero: downloaded until the local disk filled); one planted as a FIFO
    # hung the restore in open(). As on the local tier, only regular files below the root are read.
    import os
    import threading

    import crc32c

    from safepoint.store.checksum import crc_hex

    durable, outside = tmp_path / "durable", _outside(tmp_path)
    (durable / "step-1").mkdir(parents=True)
    (durable / "step-1" / "link").symlink_to(outside / "victim")
    os.mkfifo(durable / "step-1" / "fifo")
    store, base = open_store(str(durable), None, None)
    size, crc = 15, crc_hex(crc32c.crc32c((outside / "victim").read_bytes()))
    results: dict[str, object] = {}

    def attempt(name: str) -> None:
        key, out = f"{base}/step-1/{name}", tmp_path / f"got-{name}"
        for what, call in (
            ("get_bytes", lambda: store.get_bytes(key)),
            ("download", lambda: store.download(key, os.open(out, os.O_CREAT | os.O_WRONLY), size)),
            ("check", lambda: store.check(key, size, crc)),
            ("open_read", lambda: store.open_read(key, block_size=1 << 20)),
        ):
            try:
                results[f"{name} {what}"] = call()
            except (OSError, UploadError) as e:
                results[f"{name} {what}"] = e

    for name in ("link", "fifo"):
        t = threading.Thread(target=attempt, args=(name,), daemon=True)
        t.start()
        t.join(10)
        if t.is_alive():  # blocked opening the FIFO: a writer's open and close lets it go
            os.close(os.open(durable / "step-1" / "fifo", os.O_WRONLY))
            t.join(10)
            pytest.fail(f"reading the {name} blocked: {results}")
    for what, got in results.items():
        assert isinstance(got, (OSError, UploadError, str)), f"{what} read it: {got!r}"
        assert "\n" not in str(got)


def test_the_store_reads_its_own_regular_files_whole_in_ranges_and_streamed(tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    (durable / "step-1").mkdir(parents=True)
    (durable / "step-1" / "a").write_bytes(b"0123456789")
    store, base = open_store(f"file://{durable}/", None, None)
    key = f"{base}/step-1/a"
    assert store.get_bytes(key) == b"0123456789"
    assert store.stored_checksum(key) == (10, None)
    assert store.check(key, 10, store.read_crc(key, 10)) is None
    with store.open_read(key, block_size=4) as f:
        assert f.size == 10
        f.seek(3)
        assert f.read(4) == b"3456"
