"""Keeps benchmarks/bench_save.py from rotting: a tiny run must finish and write its JSON. No timing asserts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.helpers.example_runs import run_job

SCRIPT = REPO / "benchmarks" / "bench_save.py"


def test_bench_save_tiny_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [
        str(SCRIPT),
        "--size-mib=8",
        "--rounds=1",
        "--warmup=0",
        f"--out={out}",
        f"--disk-dir={tmp_path / 'disk'}",
        # A plain directory stands in for /dev/shm: same code path, nothing left in shared memory.
        f"--shm-dir={tmp_path / 'shm'}",
        "--no-drop-caches",
    ]
    # ``python benchmarks/bench_save.py ...`` forked from the suite's fork server (torch, DCP and safepoint
    # imported once: ~4.5 s of CPU less; what rots is the script, not the interpreter's start).
    proc = run_job(cmd, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    result = json.loads((out / "bench_save.json").read_text())
    assert set(result) >= {"meta", "config", "runs", "summary"}
    assert set(result["meta"]) >= {"nproc", "ram_gib", "torch", "crc32c_hardware_based", "locations", "state"}
    assert result["config"]["size_mib"] == 8

    seen = {(r["phase"], r["location"], r["variant"]) for r in result["runs"]}
    for loc in ("disk", "shm"):
        for variant in ("safepoint", "safepoint-writer", "dcp", "torch.save", "dd"):
            assert ("save", loc, variant) in seen
        for variant in ("safepoint", "safepoint-noverify", "verify", "dcp"):
            assert ("restore", loc, variant) in seen
    for run in result["runs"]:
        assert set(run) >= {"phase", "location", "cache", "variant", "round", "seconds", "bytes"}

    rows = {(r["phase"], r["location"], r["variant"]): r for r in result["summary"]}
    for key in (("save", "disk", "safepoint"), ("restore", "shm", "safepoint")):
        row = rows[key]
        assert set(row) >= {"median_s", "mb_s", "paired_ratio", "ratio_of_medians", "target", "met"}
        assert row["target"] is not None
    # Every checkpoint it wrote is deleted again.
    assert not any((tmp_path / "disk").rglob("*.distcp"))
    assert not any((tmp_path / "shm").rglob("*.distcp"))


ASYNC_SCRIPT = REPO / "benchmarks" / "bench_async.py"


@pytest.mark.slow
def test_bench_async_tiny_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(ASYNC_SCRIPT),
        "--size-mib=4",
        "--rounds=1",
        "--warmup=0",
        "--train-mib=1",
        "--width=128",
        "--batch=4",
        "--every=2",
        "--train-rounds=1",
        "--train-warmup=0",
        "--train-threads=1",
        # DCP's writer process (spawn + gloo) costs seconds; the full benchmark measures it.
        "--train-variants=none,safepoint-async,safepoint-sync,dcp-thread",
        f"--out={out}",
        f"--disk-dir={tmp_path / 'disk'}",
        f"--shm-dir={tmp_path / 'shm'}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    result = json.loads((out / "bench_async.json").read_text())
    assert set(result) >= {"meta", "config", "blocking", "train"}
    assert result["config"]["size_mib"] == 4
    blocking = result["blocking"]
    assert set(blocking) >= {"bytes", "runs", "summary", "breakdown_median", "staging_allocations"}
    seen = {(r["location"], r["variant"]) for r in blocking["runs"]}
    for loc in ("disk", "shm"):
        for variant in ("safepoint-async", "dcp-async", "safepoint-sync", "copy"):
            assert (loc, variant) in seen
    for row in blocking["summary"]:
        assert set(row) >= {"location", "variant", "median_s", "x_copy", "x_sync", "met"}
    assert set(blocking["breakdown_median"]) >= {
        "capture_s",
        "check_s",
        "copy_s",
        "bare_copy_s",
        "torch_check_s",
    }
    assert set(blocking["staging_allocations"].values()) == {1}
    train = result["train"]
    assert {r["variant"] for r in train["summary"]} == {
        "none",
        "safepoint-async",
        "safepoint-sync",
        "dcp-thread",
    }
    for row in train["summary"]:
        assert set(row) >= {"threads", "variant", "steps_s", "x_none", "contention_per_save_s", "met"}
    # Every checkpoint it wrote is deleted again.
    assert not any((tmp_path / "disk").rglob("*.distcp"))
    assert not any((tmp_path / "shm").rglob("*.distcp"))


@pytest.mark.slow  # 40 s of peers (torch-checkpointing's import and process pool); bench_save/async stay
def test_bench_peers_tiny_run(tmp_path: Path) -> None:
    # Every variant once on a tiny state (the torch-checkpointing ones only where the bench extra is installed).
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "bench_peers.py"),
        "--layers=4",
        "--width=64",
        "--rounds=1",
        f"--base={tmp_path / 'base'}",
        f"--out={out}",
    ]
    (tmp_path / "base").mkdir()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "bench_peers.json").read_text())
    seen = {(r["state"], run["phase"], run["variant"]) for r in result["results"] for run in r["runs"]}
    for state in ("small", "large"):
        for variant in ("torch.save", "safepoint-sync", "safepoint-async", "dcp.save", "dcp.async_save"):
            assert (state, "save", variant) in seen
        for variant in ("torch.load", "safepoint", "dcp.load"):
            assert (state, "restore", variant) in seen
