"""The safepoint CLI against real checkpoints written by CheckpointManager.

Most cases call ``main([...])`` in-process (fast); a few run ``python -m safepoint.cli`` end to end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import safepoint
from safepoint.cli.main import main
from tests.conftest import REPO
from tests.helpers import forkserver
from tests.helpers.example_runs import JOB_IMPORTS, job_env

STEPS = (10, 20, 30)


def make_model(hidden: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))


def clone_sd(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


@pytest.fixture(autouse=True)
def _plain_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    # Deterministic rich output: wide, no colour codes.
    monkeypatch.setenv("COLUMNS", "200")
    for var in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def trained(root: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Checkpoints at STEPS (model + optimizer + scheduler); returns the model weights saved at each step."""
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    state = safepoint.TrainState(model=model, optimizer=opt, scheduler=sched)
    saved = {}
    with safepoint.CheckpointManager(root) as mgr:
        for step in range(1, STEPS[-1] + 1):
            loss = model(torch.randn(16, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if step in STEPS:
                mgr.save(step, state, metrics={"loss": 1.0 / step})
                saved[step] = clone_sd(model)
    return saved


def cli(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def data_file(root: Path, step: int) -> Path:
    (f,) = sorted((root / f"step-{step}").glob("*.distcp"))
    return f


def ls_json(capsys: pytest.CaptureFixture[str], root: Path, *extra: str) -> list[dict[str, Any]]:
    rc, out, _ = cli(capsys, "ls", root, "--json", *extra)
    assert rc == 0
    result: list[dict[str, Any]] = json.loads(out)
    return result


# ---- ls ----------------------------------------------------------------------------------------------


def test_ls_json_lists_every_checkpoint(trained: Any, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    entries = ls_json(capsys, root)
    with safepoint.CheckpointManager(root) as mgr:
        infos = {i.step: i for i in mgr.list()}
    assert [e["step"] for e in entries] == list(STEPS)
    for e in entries:
        info = infos[e["step"]]
        assert e["status"] == "ok"
        assert e["path"] == info.path
        assert e["bytes"] == info.bytes > 0
        assert e["time"] == info.time
        assert e["metrics"] == {"loss": pytest.approx(1.0 / e["step"])}
        assert e["tier"] == "local"
        assert e["world_size"] == 1


def test_json_paths_are_absolute_for_a_relative_root(
    trained: Any, root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A script consuming the JSON may run elsewhere; a path relative to our cwd would point nowhere.
    (root / "step-40").mkdir()  # partial: its path comes from the directory listing, not a manifest
    monkeypatch.chdir(root.parent)
    entries = ls_json(capsys, Path(root.name))
    assert [(e["step"], e["path"]) for e in entries] == [(s, str(root / f"step-{s}")) for s in (*STEPS, 40)]
    rc, out, _ = cli(capsys, "inspect", f"./{root.name}", "--json")
    assert rc == 0 and json.loads(out)["path"] == str(root / "step-30")


def test_ls_table(trained: Any, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "ls", root)
    assert rc == 0
    for step in STEPS:
        assert re.search(rf"│\s+{step} │.*│ ok\s+│ local\s+│ loss=", out)


def test_ls_shows_corrupt_and_partial(trained: Any, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flip_byte(root / "step-20" / "safepoint.json", offset=40)  # still JSON-ish, fails the self-checksum
    partial = root / "step-40"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"x" * 100)  # a save that died before its manifest
    by_step = {e["step"]: e for e in ls_json(capsys, root)}
    assert by_step[10]["status"] == by_step[30]["status"] == "ok"
    assert by_step[20]["status"] == "corrupt"
    assert "safepoint.json" in by_step[20]["reason"]
    assert by_step[40]["status"] == "partial"
    assert by_step[40]["bytes"] == 100
    rc, out, _ = cli(capsys, "ls", root)
    assert rc == 0
    assert re.search(r"│\s+20 │.*corrupt", out) and re.search(r"│\s+40 │.*partial", out)


def test_ls_verify_catches_damaged_data(trained: Any, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flip_byte(data_file(root, 10))
    assert {e["step"]: e["status"] for e in ls_json(capsys, root)}[10] == "ok"  # manifest only
    verified = {e["step"]: e for e in ls_json(capsys, root, "--verify")}
    assert verified[10]["status"] == "corrupt" and "crc32c" in verified[10]["reason"]
    assert verified[30]["status"] == "ok"


# ---- verify ------------------------------------------------------------------------------------------


def test_verify_intact(trained: Any, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "verify", root)
    assert rc == 0 and "step 30" in out and "step 10" not in out  # default: the newest only
    rc, out, _ = cli(capsys, "verify", root, "--all")
    assert rc == 0 and "3 checked: 3 intact, 0 corrupt" in out
    assert cli(capsys, "verify", root, "--step", 20)[0] == 0


def test_verify_flipped_byte_fails(trained: Any, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = data_file(root, 20)
    flip_byte(bad)
    rc, out, _ = cli(capsys, "verify", root, "--all")
    assert rc == 1
    (line,) = [ln for ln in out.splitlines() if "CORRUPT" in ln]
    assert "step 20" in line and bad.name in line and "crc32c" in line
    assert "1 corrupt" in out
    assert cli(capsys, "verify", root, "--step", 20)[0] == 1
    assert cli(capsys, "verify", root)[0] == 0  # the newest is intact


def test_verify_lists_every_problem(trained: Any, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step = root / "step-30"
    with open(data_file(root, 30), "r+b") as f:
        f.truncate(10)
    flip_byte(step / ".metadata")
    rc, out, _ = cli(capsys, "verify", root)
    assert rc == 1
    problems = [ln for ln in out.splitlines() if "CORRUPT" in ln]
    assert len(problems) == 2
    assert any(".metadata" in p and "crc32c" in p for p in problems)
    assert any(".distcp" in p and "size 10" in p for p in problems)


def test_verify_errors_exit_2(
    trained: Any, root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = cli(capsys, "verify", root, "--step", 15)
    assert rc == 2 and "no committed checkpoint for step 15" in err and "Traceback" not in err
    rc, _, err = cli(capsys, "verify", tmp_path / "nope")
    assert rc == 2 and err.splitlines() == [
        f"safepoint: error: checkpoint root {tmp_path / 'nope'} does not exist"
    ]
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = cli(capsys, "verify", empty)
    assert rc == 2 and "no committed checkpoint" in err
    assert cli(capsys, "verify", root, "--step", 10, "--all")[0] == 2


# ---- inspect -----------------------------------------------------------------------------------------


def test_inspect_shows_keys_shapes_dtypes(
    trained: Any, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = cli(capsys, "inspect", root, "--step", 20)
    assert rc == 0
    assert re.search(r"^step\s+20\s*$", out, re.M)
    assert "loss=0.05" in out and "world size" in out and "torch=" in out
    assert re.search(r"^model: 4 tensors", out, re.M) and re.search(r"^optimizer: ", out, re.M)
    assert re.search(r"│ 0\.weight\s+│ \[8, 4\]\s+│ float32\s+│\s+128 bytes │", out)
    assert re.search(r"│ state\.2\.bias\.exp_avg\s+│ \[2\]\s+│ float32", out)
    assert re.search(r"│ rank_0\.torch_cpu\s+│ \[\d+\]\s+│ uint8", out)
    assert re.search(r"│ param_groups\.0\.lr\s+│ object", out)


def test_inspect_json(trained: Any, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "inspect", root, "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["step"] == 30 and doc["sections"] == ["model", "optimizer", "scheduler", "rng"]
    keys = {k["key"]: k for k in doc["keys"]}
    assert keys["model.2.weight"] == {
        "key": "model.2.weight",
        "section": "model",
        "kind": "tensor",
        "shape": [2, 8],
        "dtype": "float32",
        "bytes": 64,
    }
    assert set(doc["files"]) == {".metadata", data_file(root, 30).name, "rank-0.state", "rank-0.fingerprints"}
    # The per-rank sections come from the rank's own file, described like .metadata's keys.
    assert (
        keys["rng.rank_0.torch_cpu"]["kind"] == "tensor" and keys["rng.rank_0.torch_cpu"]["dtype"] == "uint8"
    )


def test_inspect_refuses_altered_metadata(
    trained: Any, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flip_byte(root / "step-30" / ".metadata")
    rc, _, err = cli(capsys, "inspect", root)
    assert rc == 1 and "step 30" in err and ".metadata" in err and "crc32c" in err


# ---- export ------------------------------------------------------------------------------------------


def test_export_torch_model_only_roundtrip(
    trained: dict[int, dict[str, torch.Tensor]],
    root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "model.pt"
    rc, stdout, _ = cli(capsys, "export", root, out, "--format", "torch", "--model-only", "--step", 20)
    assert rc == 0 and "step 20" in stdout
    fresh = make_model()
    fresh.load_state_dict(torch.load(out, weights_only=True))
    assert_bitwise(clone_sd(fresh), trained[20])
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]


def test_export_safetensors_roundtrip(
    trained: dict[int, dict[str, torch.Tensor]],
    root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "model.safetensors"
    assert cli(capsys, "export", root, out, "--format", "safetensors", "--model-only")[0] == 0
    fresh = make_model()
    fresh.load_state_dict(load_file(out))
    assert_bitwise(clone_sd(fresh), trained[30])


def test_export_dtype_converts_model_floats_only(
    trained: dict[int, dict[str, torch.Tensor]],
    root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "bf16.safetensors"
    assert (
        cli(capsys, "export", root, out, "--format", "safetensors", "--model-only", "--dtype", "bf16")[0] == 0
    )
    assert_bitwise(load_file(out), {k: v.to(torch.bfloat16) for k, v in trained[30].items()})
    full = tmp_path / "full.pt"
    assert cli(capsys, "export", root, full, "--format", "torch", "--dtype", "fp16")[0] == 0
    sd = torch.load(full, weights_only=True)
    assert {v.dtype for v in sd["model"].values()} == {torch.float16}
    # Optimizer moments and RNG state are exact state, not weights: left as saved.
    assert sd["optimizer"]["state"]["0.weight"]["exp_avg"].dtype == torch.float32
    assert sd["rng"]["rank_0"]["python_gauss"].dtype == torch.float64


def test_export_full_state(
    trained: dict[int, dict[str, torch.Tensor]],
    root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "full.pt"
    assert cli(capsys, "export", root, out, "--format", "torch", "--step", 10)[0] == 0
    sd = torch.load(out, weights_only=True)
    assert set(sd) == {"model", "optimizer", "scheduler", "rng"}
    assert_bitwise(sd["model"], trained[10])
    assert sd["optimizer"]["param_groups"][0]["lr"] == pytest.approx(1e-3)  # StepLR(10) decayed once
    assert sd["scheduler"]["last_epoch"] == 10
    st = tmp_path / "full.safetensors"
    rc, stdout, _ = cli(capsys, "export", root, st, "--format", "safetensors")
    assert rc == 0 and "left out" in stdout  # param_groups etc. are not tensors
    assert torch.equal(load_file(st)["model.0.weight"], trained[30]["0.weight"])


def test_export_refuses_corrupt_and_existing(
    trained: Any, root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.pt"
    flip_byte(data_file(root, 30))
    rc, _, err = cli(capsys, "export", root, out, "--format", "torch")
    assert rc == 1 and "step 30" in err and "crc32c" in err
    assert not out.exists()
    out.write_bytes(b"keep me")
    rc, _, err = cli(capsys, "export", root, out, "--format", "torch", "--step", 20)
    assert rc == 2 and "--force" in err and out.read_bytes() == b"keep me"
    assert cli(capsys, "export", root, out, "--format", "torch", "--step", 20, "--force")[0] == 0
    assert "model" in torch.load(out, weights_only=True)


# ---- import ------------------------------------------------------------------------------------------


def restore_into_fresh(root: Path, step: int | None = None) -> dict[str, torch.Tensor]:
    torch.manual_seed(123)  # different init: only the restore can make the weights match
    fresh = make_model()
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(model=fresh, rng=False), step=step) == 0
    return clone_sd(fresh)


def test_import_torch_then_restore(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(7)
    weights = clone_sd(make_model())
    src = tmp_path / "pretrained.pt"
    torch.save(weights, src)
    rc, out, _ = cli(capsys, "import", src, root)
    assert rc == 0 and "step 0" in out
    assert cli(capsys, "verify", root)[0] == 0
    assert_bitwise(restore_into_fresh(root), weights)


def test_imported_checkpoint_restores_into_a_full_train_state(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The usual `step = mgr.restore(state)` loop starts from imported weights with a fresh optimizer."""
    torch.manual_seed(7)
    weights = clone_sd(make_model())
    src = tmp_path / "pretrained.pt"
    torch.save(weights, src)
    assert cli(capsys, "import", src, root)[0] == 0
    torch.manual_seed(123)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    with safepoint.CheckpointManager(root) as mgr:
        with pytest.warns(safepoint.CheckpointWarning, match="no 'optimizer' state"):
            assert mgr.restore(safepoint.TrainState(model=model, optimizer=opt, scheduler=sched)) == 0
        assert_bitwise(clone_sd(model), weights)
        # A regular (non-imported) checkpoint still refuses a state it does not hold.
        mgr.save(1, safepoint.TrainState(model=model))
        with pytest.raises(safepoint.StateMismatchError, match="has no 'optimizer' state"):
            mgr.restore(safepoint.TrainState(model=model, optimizer=opt))


def test_import_safetensors_then_restore(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(8)
    weights = clone_sd(make_model())
    src = tmp_path / "weights.bin"  # detected by content, not by name
    save_file(weights, str(src))
    assert cli(capsys, "import", src, root)[0] == 0
    assert_bitwise(restore_into_fresh(root), weights)


def test_export_import_roundtrip(
    trained: dict[int, dict[str, torch.Tensor]],
    root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for fmt in ("torch", "safetensors"):
        exported = tmp_path / f"full.{fmt}"
        assert cli(capsys, "export", root, exported, "--format", fmt, "--step", 20)[0] == 0
        new_root = tmp_path / f"new-{fmt}"
        rc, out, _ = cli(capsys, "import", exported, new_root)
        assert rc == 0 and "left out" in out and "optimizer" in out
        assert_bitwise(restore_into_fresh(new_root), trained[20])


def test_import_takes_model_of_a_training_checkpoint(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    src = tmp_path / "train.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}, src)
    rc, out, _ = cli(capsys, "import", src, root)
    assert rc == 0 and "left out epoch, optimizer" in out
    assert_bitwise(restore_into_fresh(root), clone_sd(model))


def test_import_refuses_existing_step0(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = clone_sd(make_model()), clone_sd(make_model())
    torch.save(first, tmp_path / "a.pt")
    torch.save(second, tmp_path / "b.pt")
    assert cli(capsys, "import", tmp_path / "a.pt", root)[0] == 0
    rc, _, err = cli(capsys, "import", tmp_path / "b.pt", root)
    assert rc == 2 and "--force" in err
    assert_bitwise(restore_into_fresh(root), first)
    assert cli(capsys, "import", tmp_path / "b.pt", root, "--force")[0] == 0
    assert_bitwise(restore_into_fresh(root), second)


def test_import_never_unpickles_code(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> Any:
            return (os.mkdir, (str(marker),))

    src = tmp_path / "evil.pt"
    torch.save({"weight": torch.ones(2), "x": Payload()}, src)
    rc, _, err = cli(capsys, "import", src, root)
    assert rc == 2 and "weights_only" in err and "mkdir" in err
    assert not marker.exists() and not root.exists()


def test_import_rejects_non_state_dicts(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({"state_dict": {"w": torch.ones(1)}, "epoch": 3}, tmp_path / "nested.pt")
    rc, _, err = cli(capsys, "import", tmp_path / "nested.pt", root)
    assert rc == 2 and "no tensors at the top level" in err
    rc, _, err = cli(capsys, "import", tmp_path / "missing.pt", root)
    assert rc == 2 and "does not exist" in err


# ---- prune -------------------------------------------------------------------------------------------


def steps_on_disk(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*"))


def test_prune_dry_run_then_real(trained: Any, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "prune", root, "--keep-last", 1, "--dry-run")
    assert rc == 0 and "would delete step 10" in out and "would delete step 20" in out
    assert steps_on_disk(root) == list(STEPS)
    rc, out, _ = cli(capsys, "prune", root, "--keep-last", 2)
    assert rc == 0 and "deleted step 10" in out
    assert steps_on_disk(root) == [20, 30]
    assert cli(capsys, "verify", root, "--all")[0] == 0


def test_prune_never_deletes_newest(trained: Any, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # loss = 1/step, so with mode=max the best is the oldest; the newest must survive anyway.
    assert cli(capsys, "prune", root, "--keep-best", 1, "--metric", "loss", "--mode", "max")[0] == 0
    assert steps_on_disk(root) == [10, 30]


def test_prune_refuses_while_writer_holds_root(
    trained: Any, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with safepoint.CheckpointManager(root):
        rc, _, err = cli(capsys, "prune", root, "--keep-last", 1)
    assert rc == 2 and "in use by pid" in err
    # One sentence after the other (the hint was glued on with "by hand.; `safepoint prune --force`").
    assert ".;" not in err and ". `safepoint prune --force` takes the root over" in err
    assert steps_on_disk(root) == list(STEPS)


def test_prune_usage_errors(trained: Any, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = cli(capsys, "prune", root)
    assert rc == 2 and "--keep-last" in err
    assert cli(capsys, "prune", root, "--keep-best", 1)[0] == 2  # no --metric
    assert cli(capsys, "prune", root, "--keep-last", 0)[0] == 2
    assert steps_on_disk(root) == list(STEPS)


# ---- diff --------------------------------------------------------------------------------------------


def test_diff_reports_max_abs_difference(
    trained: dict[int, dict[str, torch.Tensor]], root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = cli(capsys, "diff", root, 10, 30, "--model-only")
    assert rc == 1
    for key in trained[10]:
        expected = (trained[10][key].double() - trained[30][key].double()).abs().max().item()
        assert expected > 0
        assert re.search(rf"│ model\.{re.escape(key)}\s+│\s+{re.escape(f'{expected:.6g}')} │", out), key
    assert "4 keys: 0 identical, 4 differ" in out
    rc, out, _ = cli(capsys, "diff", root, 30, 30)
    assert rc == 0 and "0 differ" in out


def test_diff_lists_shape_changes_and_missing_keys(
    trained: Any, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wider = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2), nn.Linear(2, 2))
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(40, safepoint.TrainState(model=wider, rng=False))
    rc, out, _ = cli(capsys, "diff", root, 30, 40, "--model-only")
    assert rc == 1
    assert re.search(r"│ model\.0\.weight\s+│\s+- │ shape \(8, 4\) vs \(16, 4\)", out)
    assert re.search(r"│ model\.3\.weight\s+│\s+- │ only in step 40", out)
    assert "2 only in step 40" in out and "3 shape mismatches" in out


def test_diff_across_two_roots_and_two_step_paths(
    trained: dict[int, dict[str, torch.Tensor]],
    root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A resumed run against its reference: two roots (the newest step both hold, or --step N), or two
    step paths (any steps)."""
    other = tmp_path / "resumed"
    shutil.copytree(root, other)
    wider = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2), nn.Linear(2, 2))
    with safepoint.CheckpointManager(other) as mgr:
        mgr.save(40, safepoint.TrainState(model=wider, rng=False))  # only in `other`
    rc, out, _ = cli(capsys, "diff", root, other)
    assert rc == 0, out
    assert f"A: {root} step 30\nB: {other} step 30\n" in out and "0 differ" in out
    rc, out, _ = cli(capsys, "diff", root, other, "--step", 10)
    assert rc == 0 and f"A: {root} step 10\nB: {other} step 10\n" in out
    rc, out, _ = cli(capsys, "diff", root / "step-10", f"{other}/step-30/", "--model-only")
    assert rc == 1
    for key in trained[10]:
        expected = (trained[10][key].double() - trained[30][key].double()).abs().max().item()
        assert re.search(rf"│ model\.{re.escape(key)}\s+│\s+{re.escape(f'{expected:.6g}')} │", out), key
    rc, out, _ = cli(capsys, "diff", root / "step-30", other / "step-40", "--model-only")
    assert rc == 1 and f"B: {other}/step-40\n" in out and "2 only in B" in out
    assert re.search(r"│ model\.3\.weight\s+│\s+- │ only in B", out)
    rc, out, _ = cli(capsys, "diff", root / "step-20", other)  # a root alone: the step path's step
    assert rc == 0 and f"A: {root}/step-20\nB: {other} step 20\n" in out
    # Errors name what exists.
    rc, _, err = cli(capsys, "diff", root, other, "--step", 40)
    assert rc == 2 and f"no committed checkpoint for step 40 in {root}; available: [10, 20, 30]" in err
    lone = tmp_path / "lone"
    with safepoint.CheckpointManager(lone) as mgr:
        mgr.save(5, safepoint.TrainState(model=wider, rng=False))
    rc, _, err = cli(capsys, "diff", root, lone)
    assert rc == 2 and "no step is committed in both roots" in err and f"{lone}: [5]" in err
    rc, _, err = cli(capsys, "diff", root, 10, 30, "--step", 10)
    assert rc == 2 and "--step goes with two roots" in err
    rc, _, err = cli(capsys, "diff", root / "step-15", other)
    assert rc == 2 and "no committed checkpoint for step 15" in err


# ---- usage, help, pass-through -----------------------------------------------------------------------


def test_bad_args_exit_2(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for args in (
        [],
        ["nope"],
        ["ls"],
        ["export", root, "out.pt"],  # --format is required
        ["export", root, "out.pt", "--format", "onnx"],
        ["verify", root, "--step", "-1"],
        ["diff", root, "1"],
        ["diff", root],
        ["diff", root, "10", "x"],
        ["diff", root, "10", "20", "30"],
    ):
        rc, _, err = cli(capsys, *args)
        assert rc == 2, args
        assert "usage:" in err, args
    rc, _, err = cli(capsys, "inspect", "s3://bucket/run")  # ls and verify read URLs; the others do not
    assert rc == 2 and "local roots only" in err


@pytest.mark.parametrize("command", ["ls", "verify", "inspect", "export", "import", "prune", "diff"])
def test_help_has_examples(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, command, "--help")
    assert rc == 0 and "examples:" in out and f"safepoint {command} " in out


def test_demo_and_bench_are_lazy_passthroughs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, module in (("demo", "safepoint.demo.main"), ("bench", "safepoint.cli.bench")):
        seen: list[list[str]] = []
        fake = types.ModuleType(module)
        fake.main = lambda argv, seen=seen: seen.append(argv) or 3  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, module, fake)
        assert main([name, "--help", "-x", "1"]) == 3
        assert seen == [["--help", "-x", "1"]]
        monkeypatch.delitem(sys.modules, module)
        monkeypatch.setitem(sys.modules, module, None)  # import fails as if absent
        rc, _, err = cli(capsys, name)
        assert rc == 2 and "not available" in err


# ---- end to end, as a user runs it -------------------------------------------------------------------


def run_cli(*args: Any, fresh: bool = True) -> subprocess.CompletedProcess[str]:
    """``python -m safepoint.cli ARGS`` as a user runs it; ``fresh=False``: the same command in a process
    forked from the fork server (tests/helpers/example_runs.py ``run_job``: its own exit code, stdout and
    stderr), without a fresh interpreter's ~4.5 s of CPU."""
    argv = ["-m", "safepoint.cli", *map(str, args)]
    plain = ("FORCE_COLOR", "COLUMNS")  # the CLI's own default: 200 columns, no colour
    if not fresh:  # the environment of the suite's other forked jobs: they share one fork server
        env = {k: v for k, v in job_env().items() if k not in plain}
        return forkserver.run(JOB_IMPORTS, argv, env, timeout=120, cwd=str(REPO))
    env = {k: v for k, v in os.environ.items() if k not in plain}
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, env=env)


def test_end_to_end_subprocess(trained: Any, root: Path) -> None:
    proc = run_cli("ls", root, "--json")
    assert proc.returncode == 0, proc.stderr
    assert [e["step"] for e in json.loads(proc.stdout)] == list(STEPS)
    flip_byte(data_file(root, 30))
    proc = run_cli("verify", root, fresh=False)  # the interpreter's start is what the `ls` above covered
    assert proc.returncode == 1
    assert "step 30" in proc.stdout and data_file(root, 30).name in proc.stdout
    assert "Traceback" not in proc.stderr


def test_bench_rejects_unknown_suite(capsys: pytest.CaptureFixture[str]) -> None:
    from safepoint.cli import bench

    with pytest.raises(SystemExit) as e:
        bench.main(["nosuch"])
    assert e.value.code == 2 and "unknown suite 'nosuch'" in capsys.readouterr().err


def test_step_numbers_take_ascii_digits_only(
    trained: Any, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """int() and str.isdigit() read other scripts' digits: Arabic-Indic "10" as `diff ROOT A B`, in a
    `step-N` path or as `--step N` was step 10. Steps are ASCII (store/guard.py, the one step pattern)."""
    ten = "\u0661\u0660"  # Arabic-Indic digits one, zero
    rc, _, err = cli(capsys, "diff", root, ten, 30)
    assert rc == 2 and "A and B are step numbers" in err, err
    (root.parent / "other").mkdir()
    os.symlink(root / "step-10", root.parent / "other" / f"step-{ten}")
    rc, _, err = cli(capsys, "diff", root.parent / "other" / f"step-{ten}", root / "step-30")
    assert rc != 0 and "Traceback" not in err
    for command in ("inspect", "verify"):
        rc, _, err = cli(capsys, command, root, "--step", ten)
        assert rc == 2 and f"invalid int value: {ten!r}" in err, err
    rc, _, _ = cli(capsys, "inspect", root, "--step", "10")
    assert rc == 0
