"""``TransferOptions(client_retries=)``: how often the store's client library retries a request on its own,
under safepoint's attempts, on S3 (moto), GCS (fake-gcs-server) and Azure (Azurite).

Left to themselves, gcsfs retries a 5xx 5 times (~35 s) and the Azure SDK 3 times (~60 s) before
safepoint hears of it, and fsspec's storage options cannot change either. The proxy in front of each store
answers every write of one object with the store's own ``503`` and counts what arrives: with
``client_retries=0`` the store sees exactly safepoint's attempts, each once.
"""

from __future__ import annotations

import pytest

from safepoint.remote.open import open_store
from safepoint.remote.retry import TransferOptions, UploadError
from tests.helpers.s3 import running_proxy
from tests.helpers.stores import Store
from tests.helpers.tcpproxy import proxied_options


def test_client_retries_zero_leaves_every_retry_to_safepoint(store: Store) -> None:
    bucket = store.make_bucket()
    with running_proxy(store.endpoint) as proxy:
        opts = proxied_options(store, proxy.endpoint)
        if store.scheme == "s3":  # a user's own botocore policy: overridden for safepoint's store only
            opts["config_kwargs"] = {"retries": {"max_attempts": 4, "mode": "standard"}}
        cfg = TransferOptions(attempts=2, backoff_s=0.0, client_retries=0)
        s, base = open_store(f"{store.scheme}://{bucket}/run", opts, cfg)
        # (gcsfs names a small object in its upload's body: every upload is answered 503)
        proxy.add("503", path="probe-object|^/upload/")
        with pytest.raises(UploadError, match="after 2 attempts") as e:
            s.put_bytes(f"{base}/probe-object", b"x" * 100)
        assert "\n" not in str(e.value)
        sent = [p for m, p, what in proxy.seen if what == "503"]
        assert len(sent) == 2, sent
        proxy.clear()
        s.put_bytes(f"{base}/probe-object", b"y" * 100)  # the store is back: the same store works
        assert s.get_bytes(f"{base}/probe-object") == b"y" * 100


def test_client_retries_is_validated() -> None:
    for bad in (-1, True, 1.5, "3"):
        with pytest.raises(ValueError, match="client_retries must be None or an int >= 0"):
            TransferOptions(client_retries=bad)  # type: ignore[arg-type]
