"""The blob lease a block upload to Azure holds from its first Put Block to its Put Block List, so that no
other writer's block can become part of the blob.

Azure commits, for each block ID in the list, whatever block was staged last under that ID, and checks no
content: another writer who stages a block under one of our IDs between our Put Block and our Put Block
List (anyone who may read the blob can list its uncommitted block IDs, so a random ID alone does not keep
it out) would have its bytes committed, every one of our blocks having been checked by Content-MD5 on the
way in. The blob's version would then be remembered as proven (remote/versions.py) and listed in the
manifest: found only at load. Azure keeps no checksum of a block blob to compare with afterwards short of
reading it back.

So the upload first makes the blob (an empty Put Blob) and takes a lease on it with a random lease ID that
Azure never shows anyone: while the lease is held, Azure refuses every Put Block and Put Block List that
does not carry that ID (``LeaseIdMissing``), and a writer who breaks the lease makes our Put Block List
fail (``LeaseNotPresentWithBlobOperation``: the upload is made again). The lease lasts ``LEASE_S`` (Azure's
longest finite one, so a killed writer's lease lapses within a minute) and is renewed in the background
every ``RENEW_S``; where no renewal succeeded for ``LAPSE_S`` (a stalled loop, a store that was down), it
may have lapsed, and another writer could have staged blocks meanwhile: the upload is then made again too.
A lease left by a killed writer is broken by the next upload to that key (ours: only the root's lease
holder writes there) and by a delete of the blob (AzureStore.delete).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

log = logging.getLogger("safepoint")

LEASE_S = 60
"""The lease's duration: Azure's longest finite one."""
RENEW_S = 15.0
"""How often the lease is renewed while it is held."""
LAPSE_S = 45.0
"""No renewal for this long: the lease may have lapsed (with ``LEASE_S``, a margin for a slow request)."""

_LAPSED = "LeaseMayHaveLapsed"
"""``LeaseLapsed``'s code (ours, not Azure's)."""
_LEASE_LOST = frozenset(
    {"LeaseNotPresentWithBlobOperation", "LeaseIdMismatchWithBlobOperation", "LeaseLost", "LeaseIdMissing"}
    | {_LAPSED}
)


class LeaseLapsed(Exception):
    """The lease may have lapsed (``BlobLease.check``). Shaped like Azure's refusals (an ``error_code``) and
    not transient, so that inside a retried request it ends the retries at once and, like a broken lease,
    makes the whole upload start again (azstore's ``_lost_lease``)."""

    error_code = _LAPSED


def lease_lost(e: BaseException) -> bool:
    """Whether Azure refused a request because our lease on the blob is gone (broken by another writer)."""
    return getattr(e, "error_code", None) in _LEASE_LOST


class BlobLease:
    """The lease held on one blob while its blocks go up (module docstring); ``id`` goes with every Put
    Block and the Put Block List. ``store``: the AzureStore (its ``client`` and ``aretry``)."""

    def __init__(self, store: Any, path: str, what: str) -> None:
        self._store, self._path, self._what = store, path, what
        self.id = str(uuid.uuid4())
        self._renewed = 0.0
        self._lapsed = False
        self._keeper: asyncio.Task[None] | None = None

    def _lease(self, lease_id: str | None = None) -> Any:
        from azure.storage.blob.aio import BlobLeaseClient

        return BlobLeaseClient(self._store.client(self._path), lease_id=lease_id)

    async def begin(self) -> None:
        """Make the blob (empty; a lease left on it by a killed writer broken first) and lease it."""
        await self._store.aretry(
            f"{self._what} (create)", lambda: put_over_lease(self._store, self._path, b"")
        )
        # A retried acquire whose answer was lost finds the lease held under this ID: Azure renews it.
        lease = self._lease(self.id)
        await self._store.aretry(f"{self._what} (lease)", lambda: lease.acquire(lease_duration=LEASE_S))
        self._renewed = asyncio.get_running_loop().time()
        self._keeper = asyncio.ensure_future(self._keep(lease))

    async def _keep(self, lease: Any) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(RENEW_S)
            try:
                await lease.renew()
            except Exception as e:  # tried again at the next turn; check() decides whether it lapsed
                log.debug("safepoint: renewal of the lease on %s failed: %s", self._path, e)
                continue
            now = loop.time()
            # An expired lease can be renewed where nobody wrote the blob meanwhile, but a block staged
            # meanwhile does not count as a write: a gap this long may have let one in, for good.
            self._lapsed |= now - self._renewed > LAPSE_S
            self._renewed = now

    def check(self) -> None:
        """Raise LeaseLapsed (the upload is made again) if the lease may have lapsed since it was taken:
        another writer's block could then be among the staged ones. Called before every attempt of the
        Put Block List and after the one that succeeded: a retry, or an answer that was slow to come, can
        follow a lapse that the check before the first attempt could not see."""
        gap = asyncio.get_running_loop().time() - self._renewed
        if self._lapsed or gap > LAPSE_S:
            raise LeaseLapsed(f"the lease on {self._store.url(self._path)} may have lapsed")

    async def end(self, *, committed: bool) -> None:
        """Stop renewing; release the lease (``committed``), else delete the blob this upload made
        (nothing of a failed upload stays at the key). Best effort: a lease left behind lapses."""
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._keeper
        with contextlib.suppress(Exception):
            if committed:
                await self._lease(self.id).release()
                return
            client = self._store.client(self._path)
            try:
                await client.delete_blob(lease=self.id)
            except Exception as e:
                if not lease_lost(e):
                    raise
                await client.delete_blob()  # our lease was broken: the key is still ours to clear


async def put_over_lease(store: Any, path: str, data: bytes, headers: dict[str, str] | None = None) -> Any:
    """Put Blob ``data`` at ``path``; a lease a killed writer left on the blob is broken first (the key is
    ours to write: only the root's lease holder writes under it). Azure's answer."""
    client = store.client(path)
    extra = {"headers": headers} if headers else {}
    try:
        return await client.upload_blob(data, overwrite=True, **extra)
    except Exception as e:
        if getattr(e, "error_code", None) != "LeaseIdMissing":
            raise
    log.info("safepoint: breaking a lease left on %s", store.url(path))
    await break_lease(store, path)
    return await client.upload_blob(data, overwrite=True, **extra)


async def break_lease(store: Any, path: str) -> None:
    """Break any lease on ``path`` at once (best effort: there may be none, or no blob)."""
    from azure.storage.blob.aio import BlobLeaseClient

    with contextlib.suppress(Exception):
        await BlobLeaseClient(store.client(path)).break_lease(lease_break_period=0)
