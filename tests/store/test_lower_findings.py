"""The lower findings of issue 23, each on a real checkpoint: values that parse but lie in rank files and
``.metadata``, forged sizes, torch's six-line refusal, and a directory durable tier's empty step dirs."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import warnings
from pathlib import Path

import crc32c
import pytest
import torch

import safepoint
from safepoint.cli.main import main
from safepoint.store.checksum import crc_hex
from safepoint.store.manifest import MANIFEST_NAME, FileEntry, Manifest
from safepoint.store.storage import METADATA_NAME, read_metadata_file


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def _save(root: Path, *steps: int) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    with safepoint.CheckpointManager(root) as mgr:
        for s in steps:
            m = _model(s)
            mgr.save(s, safepoint.TrainState(model=m))
            out[s] = {k: v.clone() for k, v in m.state_dict().items()}
    return out


def _reforge(step_dir: Path, **sizes: int) -> None:
    """Re-forge every manifest entry to the file's true size and crc (crc32c is no MAC); ``sizes``: names
    (with '.' as '_') whose size is forged to another value."""
    m = Manifest.from_json((step_dir / MANIFEST_NAME).read_bytes())
    for name in m.files:
        data = (step_dir / name).read_bytes()
        size = sizes.get(name.replace(".", "_"), len(data))
        m.files[name] = FileEntry(size=size, crc32c=crc_hex(crc32c.crc32c(data)))
    (step_dir / MANIFEST_NAME).write_bytes(m.to_json())


def _restore(root: Path, caplog: pytest.LogCaptureFixture) -> tuple[int, dict[str, torch.Tensor], str]:
    model = _model(99)
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with safepoint.CheckpointManager(root) as mgr:
            step = mgr.restore(safepoint.TrainState(model=model))
    said = caplog.text + "".join(str(w.message) + "\n" for w in seen)
    return step, dict(model.state_dict()), said


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(got[k], want[k]) for k in want)


def _cli(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue() + err.getvalue()


@pytest.mark.parametrize(
    ("key", "how"),
    [
        ("python_state", "negative"),
        ("python_state", "huge"),
        ("numpy_pos", "negative"),
        ("torch_cpu", "short"),
    ],
)
def test_a_forged_rng_state_is_corruption_found_before_anything_is_loaded(
    root: Path, key: str, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Was: OverflowError from random.setstate after the model was loaded in place, and no fallback."""
    saved = _save(root, 1, 2)
    path = root / "step-2" / "rank-0.state"
    state = torch.load(path, weights_only=True)
    rng = state["rng"]
    if how == "short":
        rng[key] = rng[key][:10].clone()
    else:
        rng[key][0] = -1 if how == "negative" else 2**40
    torch.save(state, path)
    _reforge(root / "step-2")
    step, got, said = _restore(root, caplog)
    assert step == 1 and _equal(got, saved[1])
    assert "step 2" in said and "rank-0.state" in said and "RNG" in said, said


def test_a_forged_shape_in_metadata_is_corruption_not_a_model_mismatch(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``verify`` calls the step corrupt (its items are not what .metadata says); restore must agree and fall
    back, not refuse to resume with an error blaming the model."""
    saved = _save(root, 1, 2)
    md_path = root / "step-2" / METADATA_NAME
    md = read_metadata_file(md_path)
    entry = md.state_dict_metadata["model.weight"]
    entry.size = torch.Size([5, 3])
    entry.chunks[0].sizes = torch.Size([5, 3])
    md_path.write_bytes(pickle.dumps(md))
    _reforge(root / "step-2")
    rc, out = _cli("verify", str(root), "--step", "2")
    assert rc == 1 and "CORRUPT" in out, out
    step, got, said = _restore(root, caplog)
    assert step == 1 and _equal(got, saved[1])
    assert "step 2" in said and "corrupt" in said, said


def test_a_refused_pickle_is_reported_in_one_line(root: Path) -> None:
    """torch's weights-only refusal is six lines of advice ("re-run with weights_only=False"); what reaches
    the user is the one line that says what was refused (restore refuses an unsafe checkpoint loudly)."""
    _save(root, 1, 2)
    path = root / "step-2" / "rank-0.state"
    torch.save({"rng": os.system}, path)  # a global that weights_only refuses
    _reforge(root / "step-2")
    with pytest.raises(safepoint.UnsafeCheckpointError) as e, safepoint.CheckpointManager(root) as mgr:
        mgr.restore(safepoint.TrainState(model=_model(99)))
    said = str(e.value)
    assert "\n" not in said and "rank-0.state" in said and "system" in said, said
    assert "In PyTorch 2.6" not in said and "Check the documentation" not in said, said


@pytest.mark.parametrize("size", [2**60, 2**62])
def test_a_forged_metadata_size_is_never_allocated(
    root: Path, size: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Was: MemoryError from reading .metadata by its declared size before the size was checked."""
    saved = _save(root, 1, 2)
    _reforge(root / "step-2", _metadata=size)
    step, got, _ = _restore(root, caplog)
    assert step == 1 and _equal(got, saved[1])
    rc, out = _cli("inspect", str(root), "--step", "2")
    assert rc == 1 and len(out.strip().splitlines()) == 1 and "Traceback" not in out, out


def test_retention_on_a_directory_durable_tier_leaves_no_empty_step_dirs(tmp_path: Path) -> None:
    """Was: each deleted step left an empty step-N/ that `ls` listed as a partial save forever."""
    durable, local = tmp_path / "durable", tmp_path / "local"
    with safepoint.CheckpointManager(durable, local_root=local, keep=safepoint.Keep(last=1)) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, safepoint.TrainState(model=_model(s)))
            mgr.wait()
    assert sorted(p.name for p in durable.iterdir() if p.name.startswith("step-")) == ["step-3"]
    rc, out = _cli("ls", str(durable))
    assert rc == 0 and "partial" not in out, out
