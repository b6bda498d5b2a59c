"""Incremental saves straight to an object store (no ``local_root``): the unchanged stable groups of the
previous committed step are copied server-side into the new step (S3 CopyObject, GCS rewrite, Azure Copy
Blob: no client bytes), instead of hard-linked as on a local disk.

The decision of what is unchanged is store/incremental.py's, the same as for a local root (fingerprints,
stable groups, ``full_every``); only the way a group is put into the new step differs (``copier``). Each
copy is an independent object, so every step stays complete on its own and retention deletes a step's
objects while later steps keep theirs (nothing is shared, unlike a hard link).

Trust: the previous step's record (``rank-<r>.fingerprints``) is read back from the store as hostile input
(``read_previous_remote``: its size capped by the manifest and MAX_BYTES, its crc32c checked, its shape
validated, store/incremental_record.py); a copy counts only once it is proven to hold the bytes the
manifest lists (``proven_copy``): by the crc32c the store itself computed of the copy where it keeps one
(S3's CRC32C, GCS's crc32c), else (Azure, which keeps no crc32c and whose Copy Blob status proves only that
the copy finished; an S3-compatible store without CRC32C) by the source's version this process proved
(remote/versions.py), or by reading the copy back. A source tampered in
place at the same size is then never listed under the manifest's old crc32c. Anything else (a missing or
tampered record, a copy that fails or does not match) means the group is written from memory: never a
stale byte. What each store proves of a copy, and the trade-off of the read-back: docs/storage.md.
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
from pathlib import Path
from typing import Any

from safepoint.errors import CheckpointError
from safepoint.remote.upload import ObjectStore, UploadError
from safepoint.store.incremental import Place, Record, StoredFile
from safepoint.store.incremental_record import read_newest, side_name

log = logging.getLogger("safepoint")


def read_previous_remote(layout: Any, rank: int) -> tuple[Record, int] | None:
    """(``rank``'s record in the newest committed step of a RemoteLayout, its saves since the last full
    copy), or None where there is none that verifies: the next save then writes everything."""
    try:
        return read_newest(
            layout,
            rank,
            # A ranged read of the listed size: an object grown past it is never downloaded whole.
            lambda step, size: layout.read_range(step, side_name(rank), 0, size),
            lambda step: Path(layout.step_key(step)),
        )
    except (CheckpointError, OSError, UploadError, ValueError) as e:
        log.info(
            "safepoint: no incremental record read back from %s (%s); writing everything", layout.root, e
        )
        return None


def proven_copy(store: ObjectStore, src: str, dst: str, size: int, crc: str) -> str | None:
    """Copy ``src`` to ``dst`` server-side and prove the copy holds ``size`` bytes of crc32c ``crc`` (the
    manifest's entry for ``src``); why not (the copy is then deleted), or None.

    The proof is the store's own crc32c of the copy where it keeps one (no byte read); on Azure and on S3
    without CRC32C, the copy made from a version this process proved (remote/versions.py); else the copy
    read back
    (``store.prove``): a store that keeps no checksum proves nothing of the bytes it copied, so its copy is
    never trusted by its size (a source altered in place at the same size would be listed)."""
    store.confirmed.forget(dst)
    try:
        store.copy(src, dst, size, crc)
        problem = store.prove(dst, size, crc)
    except (UploadError, OSError) as e:
        problem = f"{type(e).__name__}: {e}"
    if problem is None:
        store.confirmed.remember(dst, size, crc)  # the commit need not ask again (remote/confirmed.py)
    else:
        with contextlib.suppress(UploadError, OSError):
            store.delete([dst])  # a stray copy would lie unlisted in the step until it is deleted
    return problem


def copier(store: ObjectStore, target: str) -> Place:
    """``Round.arrange``'s ``place`` for a store: copy a previous step's group into ``target`` (the save's
    prefix) server-side and confirm the copy; None (the group is then written) if that cannot be done."""

    def place(source: Path, stored: StoredFile) -> StoredFile | None:
        src, dst = posixpath.join(str(source), stored.name), posixpath.join(target, stored.name)
        if (problem := proven_copy(store, src, dst, stored.size, stored.crc32c)) is None:
            return stored
        log.warning(
            "safepoint: server-side copy of %s failed (%s); writing its tensors instead",
            store.url(src),
            problem,
        )
        return None

    return place
