"""Records that parse but lie (issue 23): every JSON record goes through store/records.py, so NaN, absurd
numbers, deep nesting and the wrong JSON type mean "corrupt: warn, fall back", a one-line CLI error, or an
advisory file ignored; never a traceback, never a retention pass or a manager start that fails."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path

import pytest
import torch

import safepoint
from safepoint.cli.main import main
from safepoint.store.manifest import MANIFEST_NAME, Manifest

DEEP = "[" * 2000 + "]" * 2000


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def _save(root: Path, *steps: int, **kw: object) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    with safepoint.CheckpointManager(root, **kw) as mgr:  # type: ignore[arg-type]
        for s in steps:
            m = _model(s)
            mgr.save(s, safepoint.TrainState(model=m))
            out[s] = {k: v.clone() for k, v in m.state_dict().items()}
    return out


def _poison(step_dir: Path, how: str) -> None:
    """Edit the manifest's text (no checksum forged: json.loads still accepts it)."""
    path = step_dir / MANIFEST_NAME
    text = path.read_text()
    if how == "nan":
        text = text.replace('"extra": {', '"extra": {"poison": NaN, ', 1)
    elif how == "deep":
        text = text.replace('"extra": {', f'"extra": {{"poison": {DEEP}, ', 1)
    elif how == "array":
        text = "[]"
    else:  # a field out of range, checksum re-forged: only the range check can refuse it
        m = Manifest.from_json(text.encode())
        m.time = float(2**63)
        path.write_bytes(m.to_json())
        return
    path.write_text(text)


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


HOW = ["nan", "deep", "array", "time"]


@pytest.mark.parametrize("how", HOW)
def test_a_lying_manifest_means_fall_back(root: Path, how: str, caplog: pytest.LogCaptureFixture) -> None:
    saved = _save(root, 1, 2)
    _poison(root / "step-2", how)
    model = _model(99)
    with caplog.at_level(logging.WARNING, "safepoint"), safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(model=model)) == 1
    assert all(torch.equal(v, saved[1][k]) for k, v in model.state_dict().items())
    assert any("step 2" in r.getMessage() and MANIFEST_NAME in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("how", HOW)
def test_cli_reports_a_lying_manifest_in_one_line(root: Path, how: str) -> None:
    _save(root, 1, 2)
    _poison(root / "step-2", how)
    for argv in (["ls", str(root)], ["verify", str(root)], ["inspect", str(root), "--step", "1"]):
        rc, out, err = _cli(*argv)
        assert "Traceback" not in err and rc in (0, 1), (argv, err)
    rc, out, err = _cli("ls", str(root))
    assert rc == 0 and "corrupt" in out and "2" in out
    rc, out, err = _cli("verify", str(root))
    assert rc == 1 and "step 2" in out + err and MANIFEST_NAME in out + err
    rc, _, err = _cli("inspect", str(root), "--step", "2")
    assert rc == 1 and len(err.strip().splitlines()) == 1 and MANIFEST_NAME in err, err
    rc, out, err = _cli("prune", str(root), "--keep-last", "1")
    assert rc == 0 and "Traceback" not in err, err
    assert (root / "step-1").is_dir()  # the newest verified checkpoint is kept


@pytest.mark.parametrize("how", HOW)
def test_a_lying_old_manifest_never_stops_retention(root: Path, how: str) -> None:
    _save(root, 1, 2)
    _poison(root / "step-1", how)
    _save(root, 3, 4, 5, keep=safepoint.Keep(last=2))
    steps = sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))
    assert steps == ["step-1", "step-4", "step-5"]  # step 2 and 3 went; the corrupt one is left for a human


@pytest.mark.parametrize("how", ["nan", "deep", "array"])
def test_a_tiered_manager_starts_over_a_lying_local_manifest(tmp_path: Path, how: str) -> None:
    durable, local = tmp_path / "durable", tmp_path / "local"
    saved = _save(durable, 1, 2, local_root=local)
    _poison(local / "step-2", how)
    model = _model(99)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with safepoint.CheckpointManager(durable, local_root=local) as mgr:
            assert mgr.restore(safepoint.TrainState(model=model)) == 2
    assert all(torch.equal(v, saved[2][k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "text",
    [
        "NaN",
        "[Infinity]",
        '{"a": -Infinity}',
        "1e400",
        DEEP,
        '{"a":' * 40 + "1" + "}" * 40,
        "1" * 5000,
        "\xff",
    ],
)
def test_the_reader_refuses_what_no_writer_writes(text: str) -> None:
    from safepoint.store.records import CorruptRecordError, parse_json

    with pytest.raises(CorruptRecordError, match="^some/file: ") as e:
        parse_json(text.encode("latin-1"), "some/file")
    assert "\n" not in str(e.value)


def test_the_reader_wants_an_object() -> None:
    from safepoint.store.records import CorruptRecordError, parse_object

    assert parse_object(b'{"a": [1, 2.5, "x", null, true]}', "r") == {"a": [1, 2.5, "x", None, True]}
    with pytest.raises(CorruptRecordError, match="r: a JSON array, not an object"):
        parse_object(b"[]", "r")


@pytest.mark.parametrize(
    "text", ['{"version": 1, "attempts": NaN}', DEEP, "[]", '{"attempts": [{"start": 1e400}]}']
)
def test_a_lying_run_history_is_ignored_and_the_manager_starts(
    tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``.attempts.json`` (ROOT) and ``.uploads.json`` (local tier) are advice: ignored with a warning."""
    durable, local = tmp_path / "durable", tmp_path / "local"
    _save(durable, 1, local_root=local)
    for where in (durable, local):  # the run history lives in the layout the manager plans with
        (where / ".attempts.json").write_text(text)
    (local / ".uploads.json").write_text(text.replace("attempts", "uploads"))
    with caplog.at_level(logging.WARNING, "safepoint"):
        with safepoint.CheckpointManager(durable, local_root=local, save_every_seconds="auto") as mgr:
            assert mgr.restore(safepoint.TrainState(model=_model(9))) == 1
    assert ".attempts.json" in caplog.text and ".uploads.json" in caplog.text, caplog.text
