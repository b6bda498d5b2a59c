"""Which ``ObjectStore`` serves a root URL: S3's, Azure's and GCS's stores, or the generic fsspec one."""

from __future__ import annotations

from typing import Any

from fsspec.core import url_to_fs

from safepoint.remote.clientretry import with_client_retries
from safepoint.remote.upload import ObjectStore, TransferOptions
from safepoint.store.rootfs import RootDir


def open_store(
    url: str, storage_options: dict[str, Any] | None, cfg: TransferOptions | None
) -> tuple[ObjectStore, str]:
    """The store for ``url`` and the root's path inside it (no protocol)."""
    protocol = url.split("://", 1)[0]
    try:
        fs, path = url_to_fs(url, **(storage_options or {}))
    except ImportError as e:
        extra = " (pip install 'safepoint[s3]')" if protocol in ("s3", "s3a") else ""
        raise ValueError(f"root {url!r} needs the {protocol}:// file system's package{extra}: {e}") from e
    except ValueError as e:
        raise ValueError(
            f"root {url!r}: unknown protocol {protocol!r}: no fsspec file system for it ({e})"
        ) from e
    if cfg is not None and cfg.client_retries is not None:
        fs = with_client_retries(fs, cfg.client_retries)
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    store: ObjectStore
    if protocols & {"s3", "s3a"}:
        from safepoint.remote.s3store import S3Store

        store = S3Store(fs, cfg)
    elif protocols & {"abfs", "az", "abfss"}:
        from safepoint.remote.azstore import AzureStore

        store = AzureStore(fs, cfg)
    elif protocols & {"gs", "gcs"}:
        from safepoint.remote.gcsstore import GcsStore

        store = GcsStore(fs, cfg)
    else:
        store = ObjectStore(fs, cfg)
    if store.local:  # its writes and deletes walk the root's directories (never through a symlink)
        store.guard = RootDir(path.rstrip("/") or "/")
    if "://" in url and not store.local and protocol in protocols:
        store.scheme = protocol  # logs, listings and messages show the root as the user wrote it
    return store, path.rstrip("/")
