"""Which object versions this process has proven to hold which bytes: the proof a store that keeps no
crc32c (Azure; an S3-compatible store without CRC32C) can still give for a server-side copy without the
client reading it.

Azure gives a blob a new ETag at every write (of its bytes, its block list, its properties or metadata),
and its Copy Blob takes a condition on the source's ETag (``x-ms-source-if-match``) that it checks itself.
So once this process has proven a blob version's bytes (it wrote them, every block checked by Azure's
Content-MD5 and their crc32c combined and compared with the manifest, the blob leased meanwhile so that no
other writer's block is committed with them, remote/azlease.py; or it read them back under one unchanged
ETag), a copy made from that very version (the condition refused otherwise) holds the same bytes,
and so does the copy's own version (the ETag the copy answers with). A version altered in place since has
another ETag: it is never taken for the proven one.

S3 the same way (s3read.py, s3store.py), where the store keeps no CRC32C of an object (a store that does
keeps using it, and nothing is remembered): an object's ETag is the MD5 of its bytes (of its parts' MD5s
for a multipart upload) or a new value at every write, and CopyObject and UploadPartCopy take the condition
``CopySourceIfMatch``. A version is proven where this process wrote it (the crc32c of the bytes sent
compared with the manifest, and the ETag of the HEAD after the upload the one those bytes make, from
their MD5s: what Azure's Content-MD5 shows; S3Reader.settle) or read it back under one ETag (every
ranged GET ``If-Match``, and still that ETag after the read); the copy's own ETag is CopyObject's or the
completion's answer. Since a store may ignore the condition (moto does), a single-part version's copy
must answer the source's ETag (the MD5 of the bytes copied), and a multipart version must still be the
source after the copy (a HEAD).

In memory only, per process: nothing read back from the store vouches for a version (a record there could
be rewritten along with the blob), so after a restart the first copy of each group is read back once
(remote/incremental_copy.py ``proven_copy``) and proven from then on. Bounded: the oldest entries go first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

MAX_VERSIONS = 65_536
"""Entries kept (a few hundred bytes each); a forgotten version is only read back again when copied."""


class ProvenVersions:
    """{object path: (version tag, size, crc32c)} of the versions proven in this process; thread-safe."""

    def __init__(self, limit: int = MAX_VERSIONS) -> None:
        self._limit = limit
        self._known: OrderedDict[str, tuple[str, int, str]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, path: str, tag: str | None, size: int, crc: str) -> None:
        """``path``'s version ``tag`` holds ``size`` bytes of crc32c ``crc`` (proven by the caller)."""
        with self._lock:
            self._known.pop(path, None)
            if tag:
                self._known[path] = (tag, size, crc)
                while len(self._known) > self._limit:
                    self._known.popitem(last=False)

    def forget(self, path: str) -> None:
        with self._lock:
            self._known.pop(path, None)

    def tag(self, path: str, size: int, crc: str) -> str | None:
        """The proven version of ``path`` holding ``size`` bytes of crc32c ``crc``, if any."""
        with self._lock:
            known = self._known.get(path)
        return known[0] if known is not None and known[1:] == (size, crc) else None
