"""The requests a save and a restore send to each object store, pinned (docs/storage.md "Requests per
save"): every request is latency on a real store (10-50 ms each on S3), so one more per save is a
regression this file shows, and one fewer is a change to write down here and in the docs.

Counted by an HTTP proxy in front of the store (tests/helpers/s3.py, the real requests of s3fs, gcsfs and
adlfs), by kind: the root's lease, a manifest, another object, a listing. The lease's heartbeat and the
run journal's mirror run on their own threads, on timers: both are pushed out of the test's time (a
heartbeat an hour away, a journal copied at close), so what is counted is what the save itself sends.
"""

from __future__ import annotations

import collections
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import safepoint
from safepoint.remote.open import open_store
from tests.helpers.s3 import FaultProxy, running_proxy
from tests.helpers.stores import Store
from tests.helpers.tcpproxy import proxied_options

# A steady save of a small model straight to the store (step 4: keep_last=2 removes step 2), and a restore
# of the newest step by a new manager: {"METHOD kind": requests}. Before this file (6ee7a62): a steady save
# 27 requests on S3, 47 on GCS, 36 on Azure; a restore 11, 38, 12 (docs/benchmarks.md).
STEADY_SAVE = {
    # new step's manifest absent? (re-save check); 4 objects (.metadata, data, fingerprints, rank state),
    # each confirmed by its PUT's answer, and asked about once more by the commit (in place: a stale
    # owner's upload may have replaced one since, remote/confirmed.py); the lease read before the commit
    # and before each delete; the manifest (conditional create); retention: a listing of the root, the old
    # manifest, its objects.
    "s3": {
        "HEAD manifest": 1,
        "PUT object": 4,
        "HEAD object": 4,
        "GET lease": 3,
        "PUT manifest": 1,
        "GET listing": 2,
        "POST delete": 2,
    },
    # the same, as simple uploads whose answers confirm them; GCS and Azure delete one object a request
    "gs": {
        "GET manifest": 1,
        "POST upload": 5,
        "GET object": 4,
        "GET lease": 3,
        "GET listing": 2,
        "DELETE manifest": 1,
        "DELETE object": 4,
    },
    "az": {
        "HEAD manifest": 1,
        "PUT object": 4,
        "HEAD object": 4,
        "PUT manifest": 1,
        "GET lease": 3,
        "GET listing": 2,
        "DELETE manifest": 1,
        "DELETE object": 4,
    },
}
# The root listed; the newest manifest (discovery, then verify); each object's size (verify), the data
# object's again as the reader opens it, then .metadata, the data and the rank state read.
RESTORE = {
    "s3": {"GET listing": 1, "GET manifest": 2, "HEAD object": 5, "GET object": 3},
    "gs": {"GET listing": 1, "GET manifest": 2, "GET object": 8},
    "az": {"GET listing": 1, "GET manifest": 2, "HEAD object": 5, "GET object": 3},
}


def _kind(method: str, raw: str) -> str:
    """``METHOD kind`` of one request: the lease, a manifest, a listing, a (batch) delete, another object."""
    url = urllib.parse.urlsplit(raw)
    path, query = urllib.parse.unquote(url.path), urllib.parse.parse_qs(url.query, keep_blank_values=True)
    if method == "POST" and "delete" in query:
        return "POST delete"  # S3's DeleteObjects
    if method == "POST" and path.startswith("/upload/"):
        return "POST upload"  # GCS: a simple upload, or a resumable one's start and its bytes
    if path.endswith("/.lease"):
        return f"{method} lease"
    if path.endswith("/safepoint.json"):
        return f"{method} manifest"
    # S3 ListObjectsV2, Azure List Blobs, GCS objects.list (a GET of the bucket's /o with a prefix)
    if method == "GET" and ("list-type" in query or query.get("comp") == ["list"] or path.endswith("/o")):
        return "GET listing"
    if method == "HEAD" and "." not in path.rsplit("/", 1)[-1] and "__" not in path:
        return "HEAD prefix"  # adlfs asking whether a name is a "directory"
    return f"{method} object"


def _counted(proxy: FaultProxy, fn: Callable[[], Any]) -> dict[str, int]:
    proxy.seen.clear()
    fn()
    seen = [(m, p) for m, p, _ in proxy.seen if "/.run/" not in urllib.parse.unquote(p)]
    return dict(collections.Counter(_kind(m, p) for m, p in seen))


@pytest.fixture
def quiet_timers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from safepoint.store import heartbeat
    from safepoint.tiers import journal_mirror

    monkeypatch.setattr(heartbeat, "HEARTBEAT_S", 3600.0)
    monkeypatch.setattr(journal_mirror, "DEFAULT_INTERVAL_S", 1e9)
    yield


def test_requests_of_a_steady_save_and_a_restore(store: Store, quiet_timers: None) -> None:
    url = store.root()
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    state = safepoint.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    counts: dict[int, dict[str, int]] = {}
    with running_proxy(store.endpoint) as proxy:
        opts = proxied_options(store, proxy.endpoint)
        kw: dict[str, Any] = {
            "storage_options": opts,
            "keep": safepoint.Keep(last=2),
            "cluster": safepoint.ClusterOptions(lease_stale_after_s=4 * 3600.0),
        }
        with safepoint.CheckpointManager(url, **kw) as mgr:
            for step in range(1, 5):
                with torch.no_grad():
                    model.weight.add_(1.0)
                counts[step] = _counted(proxy, lambda: (mgr.save(step, state), mgr.wait()))  # noqa: B023
        fresh = nn.Linear(64, 64)
        into = safepoint.TrainState(model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1))
        with safepoint.CheckpointManager(url, **kw) as mgr:
            restored: list[int] = []
            restore = _counted(proxy, lambda: restored.append(mgr.restore(into)))
    assert restored == [4] and torch.equal(fresh.weight, model.weight)
    assert counts[3] == counts[4], counts  # steady: the same requests every save
    assert counts[4] == STEADY_SAVE[store.scheme], counts[4]
    assert restore == RESTORE[store.scheme], restore


def test_an_azure_listing_is_one_request_and_leaves_directory_markers_out(azurite_endpoint: str) -> None:
    """adlfs's find asked of the prefix whether it is a blob first; the listing is one List Blobs now, and a
    hierarchical-namespace account's "directory" (a blob marked ``hdi_isfolder``) is not an object."""
    from safepoint.remote.azstore import AzureStore
    from tests.helpers.stores import azure_store

    store = azure_store(azurite_endpoint)
    container = store.make_bucket()
    with running_proxy(store.endpoint) as proxy:
        s, base = open_store(f"az://{container}/run", proxied_options(store, proxy.endpoint), None)
        assert isinstance(s, AzureStore)
        s.put_bytes(f"{base}/step-1/a", b"abc")
        mark = s.fs.service_client.get_blob_client(container, "run/step-1/sub")
        s.run(lambda: mark.upload_blob(b"", metadata={"hdi_isfolder": "true"}))
        assert _counted(proxy, lambda: s.sizes(f"{base}/step-1")) == {"GET listing": 1}
        assert s.sizes(f"{base}/step-1") == {"a": 3}
        assert s.sizes(f"{base}/nothing") == {}
