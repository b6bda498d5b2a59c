"""Verification checks each item's structure, not only checksums (issue 13, residual of finding 4).

crc32c is no MAC: a ``.metadata`` whose offsets are re-pointed inside its own data file, with the manifest
re-forged, matches every checksum. Restore refuses such a step (the bytes at the new offsets are not the
records ``.metadata`` promises) and falls back; ``verify``, ``ls --verify`` and ``prune`` must reach the same
verdict, or ``prune --keep-last 1`` keeps the crafted step and deletes the one restore would use.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import safepoint
from safepoint.cli.main import main
from safepoint.restore.restorer import CheckpointWarning
from safepoint.store.checksum import file_crc32c
from safepoint.store.manifest import MANIFEST_NAME, FileEntry, Manifest
from safepoint.store.storage import METADATA_NAME, read_metadata_file

DATA_FILE = "__0_0.distcp"


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def _save(root: Path, *steps: int) -> dict[int, dict[str, torch.Tensor]]:
    saved = {}
    with safepoint.CheckpointManager(root) as mgr:
        for step in steps:
            model = _model(step)
            mgr.save(step, safepoint.TrainState(model=model), metrics={"step": float(step)})
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return saved


def _repoint(step_dir: Path, edit: Callable[[list[tuple[Any, Any]]], list[tuple[int, int]]]) -> None:
    """Give the items of ``step_dir``'s data file new (offset, length) pairs, all inside the file, and
    re-forge the manifest so every checksum matches again."""
    md = read_metadata_file(step_dir / METADATA_NAME)
    items = sorted(
        ((i, s) for i, s in md.storage_data.items() if s.relative_path == DATA_FILE),
        key=lambda x: x[1].offset,
    )
    size = (step_dir / DATA_FILE).stat().st_size
    for (index, info), (off, length) in zip(items, edit(items), strict=True):
        assert off >= 0 and off + length <= size  # in range: the checks of finding 5 pass
        md.storage_data[index] = type(info)(info.relative_path, off, length, info.transform_descriptors)
    (step_dir / METADATA_NAME).write_bytes(pickle.dumps(md))
    m = Manifest.from_json((step_dir / MANIFEST_NAME).read_bytes())
    for name in m.files:
        got_size, crc = file_crc32c(step_dir / name)
        m.files[name] = FileEntry(size=got_size, crc32c=crc)
    (step_dir / MANIFEST_NAME).write_bytes(m.to_json())


def _shifted(items: list[tuple[Any, Any]]) -> list[tuple[int, int]]:
    """Every item one byte later and one byte shorter: no record starts there."""
    return [(s.offset + 1, s.length - 1) for _, s in items]


def _swapped(items: list[tuple[Any, Any]]) -> list[tuple[int, int]]:
    """Each tensor item pointed at the next one's record: valid records of the wrong dtype or shape."""
    spans = [(s.offset, s.length) for _, s in items]
    tensors = [k for k, (i, _) in enumerate(items) if i.offset is not None]
    rotated = tensors[1:] + tensors[:1]
    out = list(spans)
    for k, r in zip(tensors, rotated, strict=True):
        out[k] = spans[r]
    return out


def _overlapping(items: list[tuple[Any, Any]]) -> list[tuple[int, int]]:
    """The last item made to cover the whole file: every record is in range, two items share bytes."""
    spans = [(s.offset, s.length) for _, s in items]
    last_end = items[-1][1].offset + items[-1][1].length
    spans[-1] = (items[0][1].offset, last_end - items[0][1].offset)
    return spans


ATTACKS = {"shifted": _shifted, "swapped": _swapped, "overlapping": _overlapping}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_prune_keeps_the_step_restore_uses_and_verify_names_the_crafted_one(
    tmp_path: Path, attack: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    saved = _save(root, 1, 2)
    _repoint(root / "step-2", ATTACKS[attack])

    # Restore refuses step 2 and uses step 1 ...
    model = _model(999)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with safepoint.CheckpointManager(root) as mgr:
            assert mgr.restore(safepoint.TrainState(model=model)) == 1
    assert any("step 2" in str(w.message) for w in caught if issubclass(w.category, CheckpointWarning))
    for k, v in saved[1].items():
        assert torch.equal(model.state_dict()[k], v)

    # ... so verify reports step 2 corrupt, in one line naming the file and why ...
    capsys.readouterr()
    assert main(["verify", str(root), "--step", "2"]) == 1
    corrupt = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("CORRUPT")]
    assert len(corrupt) == 1 and "step 2" in corrupt[0] and DATA_FILE in corrupt[0], corrupt
    assert main(["verify", str(root), "--step", "1"]) == 0

    # ... and prune keeps step 1, the newest checkpoint restore accepts (step 2 is left alone: not counted).
    assert main(["prune", str(root), "--keep-last", "1"]) == 0
    assert (root / "step-1" / MANIFEST_NAME).is_file()
    assert (root / "step-2").is_dir()


def test_untouched_checkpoints_still_verify(tmp_path: Path) -> None:
    """The structural check accepts what safepoint writes: tensors of several dtypes and shapes, a scalar,
    an empty tensor, non-tensor state (bytes items)."""
    root = tmp_path / "ckpt"
    state = {
        "w": torch.randn(5, 7),
        "h": torch.arange(12, dtype=torch.int16).reshape(3, 4),
        "s": torch.tensor(3.5, dtype=torch.float64),
        "e": torch.empty(0, 3),
        "b": torch.ones(2, dtype=torch.bool),
        "t": torch.randn(8, 8).t(),
    }
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, safepoint.TrainState(model=_model(1), extra={**state, "note": [1, "two", 3.0]}))
    assert main(["verify", str(root), "--step", "1"]) == 0
    assert main(["ls", str(root), "--verify"]) == 0


def test_an_object_whose_pickle_is_over_a_mebibyte_verifies(tmp_path: Path) -> None:
    """Non-tensor state pickles to any size; only a tensor's data.pkl is read (and bounded)."""
    root = tmp_path / "ckpt"
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, safepoint.TrainState(model=_model(1), extra={"big": list(range(400_000))}))
    assert main(["verify", str(root), "--step", "1"]) == 0


def test_a_partly_loaded_step_then_a_corrupt_one_raises_instead_of_starting_from_scratch(
    tmp_path: Path,
) -> None:
    """Step 2 (re-pointed) fails while it is being loaded, after some of the state was overwritten; step 1
    then fails verification. Restore returned 0 (start from scratch) with half-written state: the
    "partly overwritten" verdict of step 2 was forgotten once step 1 failed too (found by the campaign's
    md_swap mutation). It must raise, as it does when step 2 is the only candidate."""
    root = tmp_path / "ckpt"
    _save(root, 1, 2)
    _repoint(root / "step-2", _swapped)
    data = bytearray((root / "step-1" / DATA_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF  # plain damage: the checksum no longer matches
    (root / "step-1" / DATA_FILE).write_bytes(bytes(data))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with safepoint.CheckpointManager(root) as mgr:
            with pytest.raises(safepoint.CheckpointError, match="partly overwritten"):
                mgr.restore(safepoint.TrainState(model=_model(999)))


def test_verify_and_prune_on_s3_reach_restores_verdict(
    moto_endpoint: str, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same attack on an object store: items are checked with ranged reads of the data object."""
    import s3fs

    from tests.helpers.s3 import storage_options

    url, opts = f"s3://{bucket}/run", storage_options(moto_endpoint)
    with safepoint.CheckpointManager(url, storage_options=opts) as mgr:
        for step in (1, 2):
            mgr.save(step, safepoint.TrainState(model=_model(step)))
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    local = tmp_path / "step-2"
    local.mkdir()
    for name in (
        METADATA_NAME,
        MANIFEST_NAME,
        DATA_FILE,
        "rank-0.state",
        "rank-0.fingerprints",
    ):  # what the manifest lists
        (local / name).write_bytes(fs.cat_file(f"{bucket}/run/step-2/{name}"))
    _repoint(local, _shifted)
    for name in (METADATA_NAME, MANIFEST_NAME):
        fs.pipe_file(f"{bucket}/run/step-2/{name}", (local / name).read_bytes())
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_endpoint)  # the CLI takes endpoints from the environment
    assert main(["verify", url, "--step", "2"]) == 1
    assert main(["verify", url, "--step", "1"]) == 0


class _ManyTensors:
    """State DCP stores as one object item (a tuple is not flattened) holding many tensors: its zip
    directory is longer than the 4 KiB at the end of the item where a tensor's is found."""

    def state_dict(self) -> dict[str, Any]:
        return {"t": tuple(torch.full((2,), float(i)) for i in range(150))}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loaded = sd


def test_an_object_holding_many_tensors_verifies(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, safepoint.TrainState(extra={"many": _ManyTensors()}))
    assert main(["verify", str(root), "--step", "1"]) == 0
