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


@pytest.fixture(autouse=True)
def _no_cached_s3_endpoint() -> Iterator[None]:
    # Tests that run the CLI in-process give it its endpoint through AWS_ENDPOINT_URL_S3, and fsspec caches
    # file systems by their arguments, not the environment: one cached for a test's proxy, stopped since,
    # answered a later test's CLI in the same worker ("Could not connect" to a dead port in a CI run).
    yield
    if (s3fs := sys.modules.get("s3fs")) is not None:
        s3fs.S3FileSystem.clear_instance_cache()


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


# The files that take longest in wall time (multi-process jobs, crash campaigns, the writer process's
# start-up), longest first, measured per file in a whole-suite run (tests/torture/README.md, "Longest first,
# for real"). pytest-xdist (`--dist loadfile`) hands files to its workers in the order of its work queue;
# one long file left for the end kept one worker busy while the others had nothing to do. Longest first,
# then everything else in its usual order: the workers finish together. The Makefile passes
# --no-loadscope-reorder: without it xdist 3.x re-sorts the files by their *number of tests*, which put
# the long multi-process files (a few tests each) last.
LONG_FIRST = (
    "tests/torture/test_torture_objstore.py",
    "tests/remote/test_object_store.py",
    "tests/remote/test_lease_faults.py",
    "tests/save/test_writer_process.py",
    "tests/remote/test_lease_pause.py",
    "tests/torture/test_torture_objreads.py",
    "tests/integrations/test_framework_examples.py",
    "tests/save/test_async.py",
    "tests/integrations/test_lightning_ranks.py",
    "tests/dist/test_distributed.py",
    "tests/cli/test_demo.py",
    "tests/torture/test_torture_crash.py",
    "tests/remote/test_incremental_direct.py",
    "tests/preempt/test_preemption_loader.py",
    "tests/save/test_incremental_process.py",
    "tests/remote/test_copy_proof.py",
    "tests/remote/test_read_faults.py",
    "tests/save/test_async_differential.py",
    "tests/cli/test_cli.py",
    "tests/integrations/test_lightning_example.py",
    "tests/dist/test_nodes.py",
    "tests/remote/test_stores.py",
    "tests/store/test_lease_namespaces.py",
    "tests/preempt/test_preemption_tiered.py",
    "tests/torture/test_torture_faults.py",
    "tests/store/test_hostile_campaign.py",
    "tests/dist/test_hostile_nodes.py",
    "tests/save/test_auto_writer.py",
    "tests/preempt/test_preemption_grace.py",
    "tests/integrations/test_lightning_callback.py",
    "tests/test_examples.py",
    "tests/integrations/test_torchtitan_fused.py",
    "tests/save/test_crash.py",
    "tests/remote/test_store_integrity.py",
    "tests/save/test_incremental_restart.py",
    "tests/remote/test_s3_versions.py",
    "tests/remote/test_multipart_copy.py",
    "tests/test_forkserver.py",
    "tests/store/test_lease.py",
    "tests/torture/test_torture_kill.py",
    "tests/preempt/test_preemption.py",
    "tests/store/test_same_job_here.py",
    "tests/torture/test_torture_soak.py",
    "tests/store/test_own_files.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order = {path: i for i, path in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: order.get(item.nodeid.split("::")[0], len(order)))  # stable within a file
