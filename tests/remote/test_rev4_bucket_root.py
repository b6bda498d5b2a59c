"""A root at the top of a bucket (container): ``s3://bucket``, ``gs://bucket``, ``az://container``.

The listings (``sizes``) asked for the keys under ``key + "/"``; at the top of a bucket the key is empty,
so they asked for keys starting with "/" and found none: every committed step was invisible (restore found
nothing to resume from and started over, retention never deleted). S3's listing (s3read.py) had that on
main; the branch's one-request Azure listing (azbase.py) copied it, where adlfs's ``find`` had listed the
container. GCS lists through gcsfs and never had it.
"""

from __future__ import annotations

import posixpath

import crc32c

from safepoint.remote.object_layout import RemoteLayout
from safepoint.remote.retry import TransferOptions
from safepoint.store.checksum import crc_hex
from safepoint.store.manifest import FileEntry, Manifest
from tests.helpers.stores import Store

DATA = b"checkpoint bytes " * 1000
CFG = TransferOptions(backoff_s=0.0, max_backoff_s=0.0, attempts=2)


def test_a_root_at_the_top_of_a_bucket_lists_its_steps(store: Store) -> None:
    layout = RemoteLayout(f"{store.scheme}://{store.make_bucket()}", store.options, transfer=CFG)
    pending = layout.new_pending(3, "a")
    layout.store.put_bytes(posixpath.join(pending, "x"), DATA)
    entry = FileEntry(size=len(DATA), crc32c=crc_hex(crc32c.crc32c(DATA)))
    layout.commit(pending, Manifest(step=3, files={"x": entry}))
    assert layout.committed_steps() == [3]
    assert sorted(layout.store.sizes(layout.step_key(3))) == ["safepoint.json", "x"]
    assert sorted(layout.store.sizes(layout.base)) == ["step-3/safepoint.json", "step-3/x"]
