"""What this process wrote to a store and saw confirmed, so the commit does not ask the store again.

A save straight to a store (no ``local_root``) confirms each object as it is written: on S3 by S3's own
CRC32C of what it received (its answer, or a HEAD where the answer has none), and where a store keeps no
CRC32C by the ETag the bytes sent make or by reading back (s3read.settle); on Azure by Content-MD5 on every
block and blob, the blocks' crc32c combined and compared with the manifest, the blob leased meanwhile; a
server-side copy counts once proven (incremental_copy.proven_copy). Committing then asked the store once
more for every object's size and checksum (a HEAD each, ``RemoteLayout.commit``) although nothing in the
store had changed since: only a takeover of the root could, and the fence right before the manifest write
refuses that. So the objects this process confirmed (path, size, crc32c) are remembered here, and the
commit of a *staged* save (a unique prefix under ``.pending/``, which no other writer names) checks only
the others (another rank's, on a store whose writes are not confirmed as they go up: GCS through gcsfs's
stream; a small object written where the store kept no checksum to confirm it). A save *in place* under
``step-N/`` is checked whole at its commit, as before: a stale owner of the same step (killed but not yet
dead, its root taken over by a restarted job that re-saves step N) can still have uploads in flight into
that prefix; the fence stops its commit, not its uploads, so only a stat just before the manifest write
sees an object it replaced after ours was confirmed (``confirm``'s ``trust``).

Per store instance and per save: ``begin`` forgets everything under a save's prefix before it writes, so
an entry under it at commit time was made by this save's own writes. Loading never trusts this: every byte
read is checked against the manifest (docs/reliability.md).
"""

from __future__ import annotations

import posixpath
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from safepoint.remote.retry import UploadError
from safepoint.store.manifest import Manifest, Parts

T = TypeVar("T")

_LIMIT = 65_536
"""Entries kept; one forgotten is only asked of the store again at the commit."""


class ConfirmedWrites:
    """{store path: (size, crc32c)} of the objects this process wrote (or copied) and saw confirmed."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    def remember(self, path: str, size: int, crc: str) -> None:
        with self._lock:
            self._known.pop(path, None)
            self._known[path] = (size, crc)
            if len(self._known) > _LIMIT:
                del self._known[next(iter(self._known))]

    def forget(self, path: str) -> None:
        with self._lock:
            self._known.pop(path, None)

    def begin(self, prefix: str) -> None:
        """A save starts writing under ``prefix``: nothing confirmed there before counts for it."""
        under = prefix.rstrip("/") + "/"
        with self._lock:
            for path in [p for p in self._known if p.startswith(under)]:
                del self._known[path]

    def holds(self, path: str, size: int, crc: str) -> bool:
        with self._lock:
            return self._known.get(path) == (size, crc)


class _Store(Protocol):
    """What ``confirm`` uses of an upload.ObjectStore (which holds the registry: importing it here would
    make a cycle)."""

    confirmed: ConfirmedWrites

    def prove(self, path: str, size: int, crc: str, parts: Parts | None = None) -> str | None: ...

    def check(
        self,
        path: str,
        size: int,
        crc: str,
        *,
        read: bool = True,
        deep: bool = False,
        parts: Parts | None = None,
    ) -> str | None: ...

    def url(self, path: str) -> str: ...

    def _parallel(self, fn: Callable[[Any], T], items: Sequence[Any]) -> list[T]: ...


def confirm(
    store: _Store, prefix: str, manifest: Manifest, *, prove: bool = False, trust: bool = True
) -> None:
    """Every object of ``manifest`` under ``prefix`` of ``store`` matches it, size and crc32c, before it is
    written; UploadError naming the first that does not. ``prove``: as a server-side copy must be
    (``store.prove``: never by its size), asked of the store for every object; otherwise, with ``trust``,
    the objects this process confirmed as it wrote them are not asked again (the module docstring).
    ``trust=False`` for a prefix another writer may also write into: a save in place under ``step-N/``,
    where a stale owner's upload of the same step, still in flight, can replace a confirmed object after
    it was confirmed (the fence stops that owner's commit, not its uploads); only a stat just before the
    manifest write sees it (tests/remote/test_rev4_confirmed_race.py)."""
    known = store.confirmed if trust else None

    def check(name: str) -> str | None:
        e, path = manifest.files[name], posixpath.join(prefix, name)
        if prove:
            return store.prove(path, e.size, e.crc32c, e.parts)
        if known is not None and known.holds(path, e.size, e.crc32c):
            return None
        return store.check(path, e.size, e.crc32c, read=False, parts=e.parts)

    names = sorted(manifest.files)
    for name, problem in zip(names, store._parallel(check, names), strict=True):
        if problem:
            raise UploadError(f"{store.url(posixpath.join(prefix, name))} cannot be committed: {problem}")
