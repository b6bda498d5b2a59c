"""A hostile or faulty root (issue 13): symlinks, FIFOs, crafted names and offsets, files replaced after
verification, unreadable files. Every case uses the real thing (real symlinks, FIFOs, directories where a
file is expected) against checkpoints written by CheckpointManager.

The rules under test: nothing outside ROOT is read or deleted; no byte that does not match the manifest is
loaded; a structural fault of one checkpoint is that checkpoint's corruption (warn, fall back), and the CLI
says so in one line with a documented exit code.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import warnings
from pathlib import Path

import pytest
import torch

import safepoint
from safepoint.cli.main import main
from safepoint.cli.tools import scan, step_dirs
from safepoint.dist import Comm
from safepoint.restore.restorer import CheckpointWarning, Restorer
from safepoint.store.checksum import file_crc32c
from safepoint.store.manifest import MANIFEST_NAME, FileEntry, Manifest
from safepoint.store.posix_layout import Layout
from safepoint.store.storage import METADATA_NAME, read_metadata_file

DATA_FILE = "__0_0.distcp"


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def _save(root: Path, *steps: int) -> dict[int, dict[str, torch.Tensor]]:
    """Checkpoints at ``steps``, each from a different model; returns the weights saved at each."""
    saved = {}
    with safepoint.CheckpointManager(root) as mgr:
        for step in steps:
            model = _model(step)
            mgr.save(step, safepoint.TrainState(model=model))
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return saved


def _restore(root: Path) -> tuple[int, dict[str, torch.Tensor], list[str]]:
    model = _model(999)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with safepoint.CheckpointManager(root) as mgr:
            step = mgr.restore(safepoint.TrainState(model=model))
    msgs = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    return step, model.state_dict(), msgs


def _reforge(step_dir: Path, drop: tuple[str, ...] = ()) -> None:
    """Recompute the manifest's sizes and checksums (crc32c is no MAC): only structural checks remain."""
    m = Manifest.from_json((step_dir / MANIFEST_NAME).read_bytes())
    for name in drop:
        m.files.pop(name)
    for name in m.files:
        size, crc = file_crc32c(step_dir / name)
        m.files[name] = FileEntry(size=size, crc32c=crc)
    (step_dir / MANIFEST_NAME).write_bytes(m.to_json())


def _assert_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# ---- finding 1 and 10: symlinks are never followed when listing, cleaning or deleting ---------------------


def test_symlinked_pending_is_left_alone_and_reported(root: Path, outside: Path) -> None:
    _save(root, 1)
    os.rmdir(root / ".pending")
    (root / ".pending").symlink_to(outside, target_is_directory=True)
    before = _tree(outside)
    with pytest.warns(UserWarning, match=r"\.pending.*not a directory"):
        with safepoint.CheckpointManager(root) as mgr:
            assert mgr.restore(safepoint.TrainState(model=_model(0))) == 1
    assert _tree(outside) == before
    assert (root / ".pending").is_symlink()


def test_symlink_inside_pending_is_removed_not_followed(root: Path, outside: Path) -> None:
    _save(root, 1)
    (root / ".pending" / "step-7-abcdef").symlink_to(outside, target_is_directory=True)
    (root / ".pending" / "replaced-step-1-1234abcd").symlink_to(outside, target_is_directory=True)
    before = _tree(outside)
    with safepoint.CheckpointManager(root):
        pass
    assert _tree(outside) == before
    assert list((root / ".pending").iterdir()) == []


def test_symlinked_step_dir_is_never_listed_walked_or_deleted(
    root: Path, outside: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(root, 1, 2)
    # A complete, valid checkpoint outside ROOT, linked in as step 9.
    os.rename(root / "step-2", outside / "step-2")
    (root / "step-9").symlink_to(outside / "step-2", target_is_directory=True)
    before = _tree(outside)
    layout = Layout(root)
    assert layout.committed_steps() == [1]
    assert 9 not in step_dirs(layout)
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "ignored" in out and "a symlink, not a directory" in out
    assert main(["prune", str(root), "--keep-last", "1"]) == 0
    assert _tree(outside) == before
    assert (root / "step-9").is_symlink()
    step, _, _ = _restore(root)
    assert step == 1


def test_step_file_that_is_not_a_directory_is_reported(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(root, 1)
    (root / "step-5").write_text("not a checkpoint")
    assert Layout(root).committed_steps() == [1]
    assert main(["ls", str(root)]) == 0
    assert "a regular file, not a directory" in capsys.readouterr().out


# ---- finding 10: one step-name pattern ------------------------------------------------------------------


@pytest.mark.parametrize("alias", ["step-02", "step-\u0662", "step-+2", "step-2 "])
def test_only_canonical_step_names_are_steps(
    root: Path, alias: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(root, 2)
    os.mkdir(root / alias)
    for f in (root / "step-2").iterdir():
        (root / alias / f.name).write_bytes(f.read_bytes())
    layout = Layout(root)
    assert layout.committed_steps() == [2]
    assert list(step_dirs(layout)) == [2]
    assert [e.step for e in scan(layout)] == [2]
    assert main(["prune", str(root), "--keep-last", "1"]) == 0
    assert "kept 1: [2]" in capsys.readouterr().out
    assert (root / alias).is_dir()


# ---- finding 10 / 4: manifest file names and contents ----------------------------------------------------


@pytest.mark.parametrize("name", ["../../outside/precious.txt", "/etc/hostname", "a/b", "..", ".", "x\x00y"])
def test_manifest_names_must_be_bare(root: Path, outside: Path, name: str) -> None:
    _save(root, 1, 2)
    step_dir = root / "step-2"
    m = Manifest.from_json((step_dir / MANIFEST_NAME).read_bytes())
    m.files[name] = FileEntry(size=7, crc32c="00000000")
    (step_dir / MANIFEST_NAME).write_bytes(m.to_json())
    layout = Layout(root)
    with pytest.raises(safepoint.CorruptCheckpointError, match="not a plain file name"):
        layout.read_manifest(2)
    step, _, msgs = _restore(root)
    assert step == 1 and any("step 2" in s for s in msgs)


@pytest.mark.parametrize("save_id", ["../../outside", "a/b", "..", "x" * 65, "\u0661"])
def test_a_save_id_that_is_not_a_plain_id_is_corruption(root: Path, save_id: str) -> None:
    # The save id names directories under .pending (a node's received replica, a restore's downloads):
    # a path in it from a hostile manifest must never become one.
    _save(root, 1, 2)
    step_dir = root / "step-2"
    m = Manifest.from_json((step_dir / MANIFEST_NAME).read_bytes())
    m.save_id = save_id
    (step_dir / MANIFEST_NAME).write_bytes(m.to_json())
    with pytest.raises(safepoint.CorruptCheckpointError, match="not a plain id"):
        Layout(root).read_manifest(2)
    step, _, msgs = _restore(root)
    assert step == 1 and any("step 2" in s for s in msgs)


@pytest.mark.parametrize("drop", [(METADATA_NAME,), (DATA_FILE,)])
def test_manifest_must_list_metadata_and_a_data_file(root: Path, drop: tuple[str, ...]) -> None:
    saved = _save(root, 1, 2)
    _reforge(root / "step-2", drop=drop)
    step, weights, msgs = _restore(root)
    assert step == 1 and any("step 2" in s for s in msgs)
    _assert_weights(weights, saved[1])


# ---- finding 5: storage paths, offsets, file types --------------------------------------------------------


def _rewrite_metadata(step_dir: Path, edit: object) -> None:
    md = read_metadata_file(step_dir / METADATA_NAME)
    for idx, info in list(md.storage_data.items()):
        md.storage_data[idx] = edit(info)  # type: ignore[operator]
    (step_dir / METADATA_NAME).write_bytes(pickle.dumps(md))
    _reforge(step_dir)


def test_storage_path_outside_the_checkpoint_is_corruption(root: Path, tmp_path: Path) -> None:
    saved = _save(root, 1, 2)
    stolen = tmp_path / "stolen.distcp"
    stolen.write_bytes((root / "step-2" / DATA_FILE).read_bytes())
    kind = type(next(iter(read_metadata_file(root / "step-2" / METADATA_NAME).storage_data.values())))
    _rewrite_metadata(
        root / "step-2", lambda i: kind(str(stolen), i.offset, i.length, i.transform_descriptors)
    )
    step, weights, msgs = _restore(root)
    assert step == 1 and any("step 2" in s and "storage path" in s for s in msgs)
    _assert_weights(weights, saved[1])


@pytest.mark.parametrize("how", ["past_end", "huge", "negative"])
def test_offsets_outside_the_file_are_corruption(root: Path, how: str) -> None:
    saved = _save(root, 1, 2)
    size = (root / "step-2" / DATA_FILE).stat().st_size
    kind = type(next(iter(read_metadata_file(root / "step-2" / METADATA_NAME).storage_data.values())))

    def edit(i: object) -> object:
        off, length = i.offset, i.length  # type: ignore[attr-defined]
        off, length = {"past_end": (size, length), "huge": (off, 4 << 30), "negative": (-1, length)}[how]
        return kind(i.relative_path, off, length, i.transform_descriptors)  # type: ignore[attr-defined]

    _rewrite_metadata(root / "step-2", edit)
    step, weights, msgs = _restore(root)
    assert step == 1 and any("step 2" in s for s in msgs)
    _assert_weights(weights, saved[1])


def _fifo_in_place_of_data(step_dir: Path) -> Path:
    fifo = step_dir / DATA_FILE
    fifo.unlink()
    os.mkfifo(fifo)
    m = Manifest.from_json((step_dir / MANIFEST_NAME).read_bytes())
    m.files[DATA_FILE] = FileEntry(size=0, crc32c="00000000")
    (step_dir / MANIFEST_NAME).write_bytes(m.to_json())
    return fifo


def _unblock(fifo: Path) -> None:
    """Give a reader blocked on ``fifo`` its EOF (if one is blocked), so a failing test cannot hang."""
    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK) if fifo.exists() else -1
    if fd >= 0:
        os.close(fd)


def test_fifo_never_blocks_verify_or_restore(root: Path) -> None:
    saved = _save(root, 1, 2)
    fifo = _fifo_in_place_of_data(root / "step-2")
    result: dict[str, object] = {}

    def run() -> None:
        result["restore"] = _restore(root)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    blocked = t.is_alive()
    while t.is_alive():
        with contextlib.suppress(OSError):
            _unblock(fifo)
        t.join(1)
    assert not blocked, "restore blocked on a FIFO"
    step, weights, msgs = result["restore"]  # type: ignore[misc]
    assert step == 1 and any("step 2" in s and "not a regular file" in s for s in msgs)
    _assert_weights(weights, saved[1])


# ---- finding 6: what is read is what was verified ---------------------------------------------------------


def test_file_replaced_after_verify_is_not_loaded(root: Path, tmp_path: Path) -> None:
    _save(root, 1)
    with safepoint.CheckpointManager(tmp_path / "other") as mgr:  # same shapes, other values
        mgr.save(1, safepoint.TrainState(model=_model(5)))
    layout = Layout(root)
    restorer = Restorer(layout, Comm(60))
    manifest = restorer.choose(None)
    assert manifest is not None and manifest.step == 1
    (root / "step-1" / DATA_FILE).write_bytes((tmp_path / "other" / "step-1" / DATA_FILE).read_bytes())
    target = _model(999)
    with pytest.raises(safepoint.CorruptCheckpointError, match=DATA_FILE):
        restorer.load(manifest, safepoint.TrainState(model=target))


# ---- finding 7: any structural fault is corruption: fall back, one line in the CLI ------------------------


def test_directory_in_place_of_a_data_file_falls_back(root: Path) -> None:
    saved = _save(root, 1, 2)
    data = root / "step-2" / DATA_FILE
    data.unlink()
    data.mkdir()
    step, weights, msgs = _restore(root)
    assert step == 1 and any("step 2" in s for s in msgs)
    _assert_weights(weights, saved[1])


def test_metadata_fields_of_the_wrong_type_fall_back(root: Path) -> None:
    saved = _save(root, 1, 2)
    kind = type(next(iter(read_metadata_file(root / "step-2" / METADATA_NAME).storage_data.values())))
    _rewrite_metadata(
        root / "step-2", lambda i: kind(i.relative_path, str(i.offset), i.length, i.transform_descriptors)
    )
    step, weights, msgs = _restore(root)
    assert step == 1 and any("step 2" in s for s in msgs)
    _assert_weights(weights, saved[1])


@pytest.mark.parametrize("command", ["inspect", "export", "diff"])
def test_cli_reports_structural_faults_in_one_line(
    root: Path, tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(root, 1, 2)
    kind = type(next(iter(read_metadata_file(root / "step-2" / METADATA_NAME).storage_data.values())))
    _rewrite_metadata(root / "step-2", lambda i: kind(i.relative_path, 10**9, i.length, None))
    argv = {
        "inspect": ["inspect", str(root), "--step", "2"],
        "export": ["export", str(root), str(tmp_path / "out.pt"), "--step", "2", "--format", "torch"],
        "diff": ["diff", str(root), "1", "2"],
    }[command]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and "step 2" in err


def test_verify_all_goes_on_past_an_unreadable_file(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _save(root, 1, 2, 3)
    data = root / "step-2" / DATA_FILE
    data.unlink()
    data.mkdir()
    assert main(["verify", str(root), "--all"]) == 1
    out = capsys.readouterr().out
    assert "ok      step 1" in out and "ok      step 3" in out and "step 2" in out
    assert "3 checked: 2 intact, 1 corrupt" in out


# ---- finding 8: conjugate and negative views --------------------------------------------------------------


class _Holder(torch.nn.Module):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("z", value)


@pytest.mark.parametrize("view", ["conj", "neg"])
@pytest.mark.parametrize("side", ["saved", "target"])
def test_conjugate_and_negative_views_round_trip(root: Path, view: str, side: str) -> None:
    torch.manual_seed(0)
    value = torch.randn(5, dtype=torch.complex64)
    make = {"conj": torch.conj, "neg": torch._neg_view}[view]
    saved = make(value.clone()) if side == "saved" else value.clone()
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, safepoint.TrainState(model=_Holder(saved)))
    blank = torch.zeros(5, dtype=torch.complex64)
    target = _Holder(make(blank) if side == "target" else blank)
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(model=target)) == 1
    assert torch.equal(target.z.resolve_conj().resolve_neg(), saved.resolve_conj().resolve_neg())


def test_save_never_writes_through_a_symlinked_pending(root: Path, outside: Path) -> None:
    _save(root, 1)
    os.rmdir(root / ".pending")
    (root / ".pending").symlink_to(outside, target_is_directory=True)
    before = _tree(outside)
    with pytest.warns(UserWarning, match=r"\.pending"):
        with safepoint.CheckpointManager(root) as mgr:
            with pytest.raises(safepoint.SaveError, match="not a directory"):
                mgr.save(2, safepoint.TrainState(model=_model(2)))
    assert _tree(outside) == before


# ---- finding 10: deleting an already-missing object on a non-S3 store is done, not an error ---------------


def test_fsspec_discard_without_a_manifest_leaks_nothing(tmp_path: Path) -> None:
    from safepoint.remote.object_layout import RemoteLayout

    layout = RemoteLayout(f"file://{tmp_path / 'store'}")
    layout.ensure_root()
    pending = layout.step_key(3)
    layout.store.fs.makedirs(pending, exist_ok=True)
    for name in (METADATA_NAME, DATA_FILE):  # a failed save: data objects, never a manifest
        layout.store.put_bytes(f"{pending}/{name}", b"x" * 10)
    layout.discard(pending)
    assert layout.store.sizes(pending) == {}
    layout.store.delete([f"{pending}/{MANIFEST_NAME}"])  # already gone: nothing to do, no error


def test_verify_all_reports_an_unreadable_file_as_nobody(tmp_path: Path) -> None:
    """A real PermissionError: root reads everything, so the CLI runs as ``nobody`` in a subprocess."""
    import pwd
    import shutil
    import subprocess
    import sys
    import tempfile

    from tests.conftest import SUBPROCESS_ENV

    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' user to drop privileges to")
    if os.geteuid() != 0:
        pytest.skip("needs root to drop privileges (as non-root, chmod 000 is enough and tested elsewhere)")
    base = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's tmp_path is not reachable by nobody
    try:
        root = base / "ckpt"
        _save(root, 1, 2, 3)
        for p in [base, *base.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        (root / "step-2" / DATA_FILE).chmod(0o600)
        code = "import sys; from safepoint.cli import main; sys.exit(main(sys.argv[1:]))"
        try:
            proc = subprocess.run(
                [sys.executable, "-c", code, "verify", str(root), "--all"],
                env=SUBPROCESS_ENV,
                user=nobody.pw_uid,
                group=nobody.pw_gid,
                capture_output=True,
                text=True,
                timeout=300,
            )
        except PermissionError as e:
            pytest.skip(f"nobody cannot run this Python ({e}); the unreadable-file path is not exercised")
    finally:
        shutil.rmtree(base)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "ok      step 1" in proc.stdout and "ok      step 3" in proc.stdout
    assert "Permission denied" in proc.stdout and "3 checked: 2 intact, 1 corrupt" in proc.stdout


# ---- found by the campaign (tests/store/test_hostile_campaign.py) ----------------------------------------------


@pytest.mark.parametrize("how", ["symlink_outside", "fifo"])
def test_a_manifest_is_never_read_through_a_symlink_or_from_a_fifo(
    root: Path, outside: Path, how: str
) -> None:
    """A manifest linked to a file elsewhere was read from there (one linked to /dev/zero was read until
    memory ran out); a FIFO blocked. Only a regular file in the step directory is a manifest."""
    saved = _save(root, 1, 2)
    manifest = root / "step-2" / MANIFEST_NAME
    if how == "symlink_outside":
        elsewhere = outside / MANIFEST_NAME
        elsewhere.write_bytes(manifest.read_bytes())  # the true manifest, kept outside ROOT
        manifest.unlink()
        manifest.symlink_to(elsewhere)
    else:
        manifest.unlink()
        os.mkfifo(manifest)
    step, weights, _ = _restore(root)
    assert step == 1
    _assert_weights(weights, saved[1])
    assert main(["verify", str(root), "--all"]) in (0, 1)  # no hang, no traceback


def test_verify_and_prune_refuse_a_forged_metadata(root: Path, tmp_path: Path) -> None:
    """A .metadata whose storage path leaves the checkpoint, with a forged manifest, verifies byte for byte;
    restore refuses it, so `verify` must report it and `prune` must not keep it as the newest (it deleted
    step 1, the newest checkpoint restore accepts)."""
    _save(root, 1, 2)
    stolen = tmp_path / "stolen.distcp"
    stolen.write_bytes((root / "step-2" / DATA_FILE).read_bytes())
    kind = type(next(iter(read_metadata_file(root / "step-2" / METADATA_NAME).storage_data.values())))
    _rewrite_metadata(
        root / "step-2", lambda i: kind(str(stolen), i.offset, i.length, i.transform_descriptors)
    )
    assert main(["verify", str(root), "--step", "2"]) == 1
    assert main(["prune", str(root), "--keep-last", "1"]) == 0
    assert (root / "step-1").is_dir() and (root / "step-2").is_dir()


def test_ls_warns_of_a_hostile_pending_in_an_empty_root(
    root: Path, outside: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root.mkdir()
    (root / ".pending").symlink_to(outside, target_is_directory=True)
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "no checkpoints" in out and "warning" in out and ".pending" in out


def test_parked_copy_is_kept_when_its_step_is_a_symlink(root: Path, outside: Path) -> None:
    """An interrupted replacement left the good copy parked in .pending; step-N is now a symlink. The link
    is not followed or replaced, and the parked copy (maybe the only good one) is kept, with a warning."""
    _save(root, 1)
    parked = root / ".pending" / "replaced-step-1-1234abcd"
    os.rename(root / "step-1", parked)
    (root / "step-1").symlink_to(outside, target_is_directory=True)
    with pytest.warns(UserWarning, match="kept the parked copy"):
        with safepoint.CheckpointManager(root):
            pass
    assert (parked / MANIFEST_NAME).is_file() and (root / "step-1").is_symlink()
    assert sorted(p.name for p in outside.iterdir()) == ["precious.txt", "sub"]


@pytest.mark.parametrize("name", ["replaced-..-x", "replaced-.-x", "replaced--x", "replaced-step-1-x"])
def test_a_planted_parked_name_never_names_root_or_its_parent(tmp_path: Path, name: str) -> None:
    """Only an exact ``replaced-step-N-<8 hex>`` is a parked replacement. A planted ``replaced-..-x`` once
    made the next owner delete ROOT's parent (every sibling, ROOT and its checkpoints), ``replaced-.-x``
    ROOT itself; any other shape is an abandoned entry and is removed, nothing else."""
    parent = tmp_path / "parent"
    root = parent / "root"
    (parent / "sibling").mkdir(parents=True)
    (parent / "sibling" / "precious.txt").write_text("keep me")
    saved = _save(root, 1)
    planted = root / ".pending" / name
    planted.mkdir()
    (planted / MANIFEST_NAME).write_text("{}")
    with safepoint.CheckpointManager(root):
        pass
    assert (parent / "sibling" / "precious.txt").read_text() == "keep me"
    assert not planted.exists()
    step, weights, msgs = _restore(root)
    assert (step, msgs) == (1, [])
    _assert_weights(weights, saved[1])


def test_a_pending_that_is_a_file_is_reported_and_restores_still_work(root: Path) -> None:
    """A .pending that is a regular file made opening the root fail with a generic 'File exists': even a
    restore was refused. It is now reported like a symlinked .pending, restores work, saves refuse."""
    saved = _save(root, 1)
    os.rmdir(root / ".pending")
    (root / ".pending").write_bytes(b"x")
    with pytest.warns(UserWarning, match=r"\.pending is a regular file, not a directory"):
        with safepoint.CheckpointManager(root) as mgr:
            model = _model(0)
            assert mgr.restore(safepoint.TrainState(model=model)) == 1
            _assert_weights(model.state_dict(), saved[1])
            with pytest.raises(safepoint.SaveError, match=r"\.pending is a regular file, not a directory"):
                mgr.save(2, safepoint.TrainState(model=model))
    assert (root / ".pending").read_bytes() == b"x"


def test_an_offset_repointed_inside_a_verified_file_falls_back(root: Path) -> None:
    """Offsets pointed at byte 1 of the data file (manifest re-forged): the bytes there are no pickle.
    That was taken for a checkpoint that tried to run code (UnsafeCheckpointError: restore stopped); it is
    damage, and restore falls back to the intact step."""
    saved = _save(root, 1, 2)
    kind = type(next(iter(read_metadata_file(root / "step-2" / METADATA_NAME).storage_data.values())))
    _rewrite_metadata(root / "step-2", lambda i: kind(i.relative_path, 1, i.length, i.transform_descriptors))
    step, weights, msgs = _restore(root)
    assert step == 1 and any("step 2" in s for s in msgs)
    _assert_weights(weights, saved[1])


def test_deleting_a_step_never_moves_it_through_a_symlinked_pending(root: Path, outside: Path) -> None:
    """Retention and prune moved the doomed step into .pending before deleting it: through a .pending that
    is a symlink, into the directory outside ROOT, and deleted it there. It is now deleted in place."""
    _save(root, 1, 2)
    os.rmdir(root / ".pending")
    (root / ".pending").symlink_to(outside, target_is_directory=True)
    os.utime(outside, (1_000_000, 2_000_000))
    assert main(["prune", str(root), "--keep-last", "1"]) == 0
    assert not (root / "step-1").exists() and (root / "step-2").is_dir()
    assert outside.stat().st_mtime == 2_000_000, "an entry was made or removed outside ROOT"
    assert sorted(p.name for p in outside.iterdir()) == ["precious.txt", "sub"]


def test_metadata_objects_missing_a_field_are_corruption(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A .metadata whose storage info comes back without `offset` (pickle restores whatever state the bytes
    carry; manifest re-forged): `verify` raised AttributeError with a traceback. It is damage."""
    saved = _save(root, 1, 2)
    md = read_metadata_file(root / "step-2" / METADATA_NAME)
    for info in md.storage_data.values():
        object.__delattr__(info, "offset")
    (root / "step-2" / METADATA_NAME).write_bytes(pickle.dumps(md))
    _reforge(root / "step-2")
    assert main(["verify", str(root), "--step", "2"]) == 1
    assert "offset" in capsys.readouterr().out
    step, weights, msgs = _restore(root)
    assert step == 1 and any("step 2" in s for s in msgs)
    _assert_weights(weights, saved[1])
