"""Shared fixtures: tiny models and helpers for real-process tests."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

# S3 on loopback (moto server) and a fault-injecting proxy, for tests/remote/test_object_store.py.
from tests.helpers.s3 import bucket, moto_endpoint, proxy  # noqa: F401

# GCS (fake-gcs-server) and Azure (Azurite) on loopback, and ``store``: each of the three in turn.
from tests.helpers.stores import azurite_endpoint, gcs_endpoint, other_store, store  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
# For a Python subprocess that imports safepoint and tests.* from this checkout.
SUBPROCESS_ENV = dict(os.environ, PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{REPO}")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


@pytest.fixture(autouse=True)
def _wide_output(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CLI renders piped output 200 columns wide unless COLUMNS says otherwise; pytest-xdist's workers
    # may inherit a COLUMNS, and a path that wraps mid-word then breaks what a test looks for in it.
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture(autouse=True)
def _quiet_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    # 2-core CI machines: keep torch from oversubscribing when several processes run.
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))


_HEARTBEATS = ("safepoint-lease", "safepoint-remote-lease")


@pytest.fixture(autouse=True)
def _no_leaked_heartbeat() -> Iterator[None]:
    # A manager left open keeps its lease's heartbeat running until the interpreter exits: at the end of
    # the run it then logs failed writes to a store the suite has already stopped. Close every manager.
    before = set(threading.enumerate())
    yield
    leaked = [t.name for t in threading.enumerate() if t.name in _HEARTBEATS and t not in before]
    if leaked:
        pytest.fail(f"lease heartbeat thread(s) still running after the test: {leaked} (close the manager)")
