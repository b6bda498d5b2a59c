"""A hostile root's ``step-N/safepoint.json`` of gigabytes: a local root reads at most MAX_MANIFEST_BYTES of
it (store/posix_layout.py), a store root downloaded it whole into memory on every ``restore``, ``ls`` and
``verify`` before judging its size (rev9b review). Now a store read of a manifest stops one byte past the
bound (``ObjectStore.get_bytes(limit=...)``): the step is corrupt, named in one line, and restore falls back
to the step before it. An empty manifest is corrupt too, never a failed read of the store."""

from __future__ import annotations

import posixpath

import pytest
import torch

import safepoint
from safepoint.remote.object_layout import RemoteLayout
from safepoint.store import posix_layout
from tests.helpers.stores import Store
from tests.helpers.tcpproxy import proxied, tcp_proxy

BOUND = 64 << 10  # the bound in this test (the product's is 64 MiB)
HUGE = 4 << 20  # the planted manifest: what a whole download would move


@pytest.fixture(autouse=True)
def _small_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(posix_layout, "MAX_MANIFEST_BYTES", BOUND)


def _two_steps(url: str, store: Store) -> None:
    state = safepoint.TrainState(objects={"w": torch.nn.Linear(2, 2)}, rng=False)
    with safepoint.CheckpointManager(url, storage_options=store.options) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)


@pytest.mark.parametrize("planted", ["huge", "empty"])
def test_a_huge_or_empty_manifest_is_refused_without_downloading_it(store: Store, planted: str) -> None:
    url = store.root()
    _two_steps(url, store)
    layout = RemoteLayout(url, store.options)
    key = posixpath.join(layout.step_key(2), "safepoint.json")
    store.fs().pipe_file(key, b"{" + b" " * HUGE if planted == "huge" else b"")
    with tcp_proxy(store.endpoint) as proxy:
        opts = proxied(store, proxy).options
        proxy.reset_counts()
        with pytest.warns(safepoint.CheckpointWarning, match="step 2"):
            with safepoint.CheckpointManager(url, storage_options=opts) as mgr:
                back = safepoint.TrainState(objects={"w": torch.nn.Linear(2, 2)}, rng=False)
                assert mgr.restore(back) == 1  # the step before it
        assert proxy.down < HUGE // 4, proxy.down  # never the whole planted object
        seen = RemoteLayout(url, proxied(store, proxy).options)
        with pytest.raises(safepoint.CorruptCheckpointError) as e:
            seen.read_manifest(2)
        assert "\n" not in str(e.value)
