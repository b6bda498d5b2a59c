"""Review of the confirmed-writes registry (remote/confirmed.py): what the commit no longer asks the store.

The commit used to ask the store about every object just before the manifest went up (a HEAD or stat
each), so an object replaced after rank 0 wrote it, by a writer the fence does not stop, was refused there.
remote/confirmed.py skips that stat for the objects this process confirmed as it wrote them, arguing that
"nothing in the store changed them since but another owner, and the lease fence right before the
manifest write refuses a taken-over root". The fence refuses the *stale* owner's commit; it does nothing
about the stale owner's uploads still in flight when the new owner saves the same step in place (the
common restart: a job that resumes from step N-k re-saves step N, which the killed-but-not-dead owner was
writing). Those uploads land in the new owner's prefix after the new owner confirmed its own object: the
new owner's fence passes (it owns the root) and it commits a manifest that no longer matches the store, a
checkpoint that cannot be restored (docs/reliability.md: "a checkpoint that could not be restored is never
committed"). The window had grown from the commit's stat-to-manifest gap to the whole save; the commit of
an in-place save now asks the store about every object again (confirm's ``trust``), as before the branch.
"""

from __future__ import annotations

import posixpath

import crc32c
import pytest

from safepoint.remote.object_layout import RemoteLayout
from safepoint.remote.retry import TransferOptions, UploadError
from safepoint.store.checksum import crc_hex
from safepoint.store.manifest import FileEntry, Manifest
from tests.helpers.stores import Store

DATA = b"checkpoint bytes " * 1000
STALE = b"stale owner's bytes " * 1000  # the other owner's state of the same step (another size)
CFG = TransferOptions(backoff_s=0.0, max_backoff_s=0.0, attempts=2)


def _manifest(step: int, **files: bytes) -> Manifest:
    entries = {n: FileEntry(size=len(b), crc32c=crc_hex(crc32c.crc32c(b))) for n, b in files.items()}
    return Manifest(step=step, files=entries)


def test_an_object_replaced_after_it_was_confirmed_is_not_committed(store: Store) -> None:
    layout = RemoteLayout(store.root(), store.options, transfer=CFG)
    pending = layout.new_pending(5, "a")
    assert pending == layout.step_key(5)  # in place: the prefix a stale owner of step 5 writes into too
    ours = posixpath.join(pending, "__0_0.distcp")
    layout.store.put_bytes(ours, DATA)  # confirmed by the store's answer (or Content-MD5)
    store.fs().pipe_file(ours, STALE)  # the stale owner's upload, delayed, lands now
    try:
        with pytest.raises(UploadError, match=r"__0_0\.distcp cannot be committed"):
            layout.commit(pending, _manifest(5, **{"__0_0.distcp": DATA}))
    finally:
        committed = layout.committed_steps()
    assert committed == []  # a manifest over bytes it does not describe is never written
