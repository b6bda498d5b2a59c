"""clientretry: how many times a store's client library retries a request on its own
(``TransferOptions.client_retries``).

safepoint retries every request itself (retry.py); the client libraries underneath retry too, each by its
own policy, and on GCS and Azure that policy waits long: one ``503`` costs 15 s on Azure, a store that stays
down ~35 s (gcsfs) or ~60 s (the Azure SDK) per safepoint attempt. None of them takes the setting through
fsspec's storage options (s3fs does, via botocore's config), so it is set here on a *private* instance of
the file system (``skip_instance_cache``): the user's own instance, which fsspec caches and shares, keeps
its policy.
"""

from __future__ import annotations

import types
from typing import Any


def with_client_retries(fs: Any, retries: int) -> Any:
    """A private copy of ``fs`` whose client retries a failed request at most ``retries`` times; ``fs``
    itself where the file system has no client library that retries (local, memory)."""
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    opts = dict(fs.storage_options)
    if protocols & {"s3", "s3a"}:
        config = dict(opts.get("config_kwargs") or {})
        policy = {k: v for k, v in dict(config.get("retries") or {}).items() if k != "max_attempts"}
        config["retries"] = {**policy, "total_max_attempts": retries + 1}
        return type(fs)(skip_instance_cache=True, **{**opts, "config_kwargs": config})
    if protocols & {"gs", "gcs"}:
        from gcsfs.retry import retry_request

        own = type(fs)(skip_instance_cache=True, **opts)
        # gcsfs fixes its tries when the class is defined (``@retry_request(retries=6)`` on ``_request``,
        # through which every JSON and upload request goes): this instance gets its own wrapper.
        plain = type(fs)._request.__wrapped__
        own._request = types.MethodType(retry_request(retries=retries + 1)(plain), own)
        return own
    if protocols & {"abfs", "az", "abfss"}:
        own = type(fs)(skip_instance_cache=True, **opts)
        # adlfs builds its Azure SDK client without retry settings; the SDK's policy object is shared by
        # every blob client made from it (adlfs's requests and safepoint's own).
        own.service_client._config.retry_policy.total_retries = retries
        return own
    return fs
