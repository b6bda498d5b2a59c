"""A server-side copy counts only once it is proven to hold the manifest's bytes (remote/incremental_copy.py
``proven_copy``), whatever the store keeps of it.

The threat: a stable group tampered with in place, at the same size, in an older step on the store. An
incremental save copies that group into its new step server-side and lists it under the manifest's old
crc32c. Where the store computes a crc32c of the copy (S3 with CRC32C, GCS) the comparison catches it; where
it keeps none (Azure; an S3-compatible store that ignores ``ChecksumAlgorithm``, played here by moto behind
a proxy that hides its CRC32C headers) the copy used to be accepted by its size and the new step committed
with bytes it cannot restore. Now such a copy is read back unless it was made from a version this process
proved (remote/versions.py; the S3 case: tests/remote/test_s3_versions.py): the tampered group is refused,
its copy deleted, and the group written from memory (direct) or uploaded from the local tier (tiered).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

import safepoint
from safepoint.remote.incremental_copy import copier
from safepoint.remote.object_layout import RemoteLayout
from safepoint.remote.upload import MiB, TransferOptions
from safepoint.store.checksum import crc_hex
from safepoint.store.incremental import StoredFile, is_stable_group
from tests.helpers.frozen_state import ADAPTER, BASE, Frozen, saves_counted
from tests.helpers.stores import Store, azure_store, gcs_store, s3_store
from tests.helpers.tcpproxy import TcpProxy, proxied, tcp_proxy

CFG = TransferOptions(part_size=5 * MiB, concurrency=4)
OVERHEAD = 256 * 1024  # as in test_incremental_direct.py
_GROUP = "__0_1000000000000000000.distcp"
# moto's CRC32C header renamed (same length): botocore no longer sees it, as with a store that keeps none.
_HIDE_CRC = (b"x-amz-checksum-crc32c", b"x-amz-checksum-crc32x")


def _fixture_store(request: pytest.FixtureRequest) -> Iterator[tuple[Store, Store, TcpProxy]]:
    """(the store as safepoint reaches it, the same store reached directly to tamper with it, the proxy in
    between that counts the bytes)."""
    kind = str(request.param)
    if kind == "s3-no-crc":
        raw = s3_store(request.getfixturevalue("moto_endpoint"))
    elif kind == "gs":
        raw = gcs_store(request.getfixturevalue("gcs_endpoint"))
    else:
        raw = azure_store(request.getfixturevalue("azurite_endpoint"))
    with tcp_proxy(raw.endpoint) as proxy:
        if kind == "s3-no-crc":
            proxy.corrupt_down = _HIDE_CRC
        yield proxied(raw, proxy), raw, proxy


@pytest.fixture(params=["s3-no-crc", "gs", "az"])
def stores(request: pytest.FixtureRequest) -> Iterator[tuple[Store, Store, TcpProxy]]:
    yield from _fixture_store(request)


def _alter_in_place(raw: Store, key: str) -> None:
    """Rewrite the object at ``key`` through the store's own API with one byte flipped: the same size."""
    fs = raw.fs()
    data = bytearray(fs.cat_file(key))
    data[-100] ^= 0xFF
    fs.pipe_file(key, bytes(data))


def test_a_copy_of_a_source_altered_in_place_is_refused_by_every_store(
    tmp_path: Path, stores: tuple[Store, Store, TcpProxy]
) -> None:
    store, raw, _ = stores
    url = store.root()
    layout = RemoteLayout(url, store.options, transfer=CFG)
    data = torch.randn(MiB // 2).numpy().tobytes()
    (tmp_path / _GROUP).write_bytes(data)
    entry = (_GROUP, len(data), crc_hex(crc32c.crc32c(data)))
    layout.put_files(layout.step_key(1), [(str(tmp_path / _GROUP), *entry)])
    src = posixpath.join(layout.step_key(1), _GROUP)
    # An intact source: the copy is proven (by the store's crc32c, or read back) and taken.
    assert layout.copy_files(1, layout.step_key(2), [entry]) == []
    assert raw.fs().cat_file(posixpath.join(layout.step_key(2), _GROUP)) == data
    _alter_in_place(raw, src)
    # Tiered: the copy is refused and deleted; the caller uploads the group from the local tier instead.
    assert layout.copy_files(1, layout.step_key(3), [entry]) == [_GROUP]
    assert not raw.fs().exists(posixpath.join(layout.step_key(3), _GROUP))
    # Direct: the copier gives the group back to be written from memory, and leaves no copy either.
    stored = StoredFile(_GROUP, {}, entry[1], entry[2], None)
    assert copier(layout.store, layout.step_key(4))(Path(layout.step_key(1)), stored) is None
    assert not raw.fs().exists(posixpath.join(layout.step_key(4), _GROUP))


def test_an_azure_copy_is_proven_by_the_version_this_process_proved_without_a_read(
    tmp_path: Path, azurite_endpoint: str
) -> None:
    """Azure keeps no crc32c: a copy from a blob version this process wrote (or read back) is made on the
    condition that the source still is that version (x-ms-source-if-match, checked by Azure), so it needs
    no read; a source altered since is refused by Azure itself, again with no read. A new process (nothing
    proven yet) reads a copy back once, then knows that copy's version."""
    raw = azure_store(azurite_endpoint)
    data = torch.randn(MiB // 2).numpy().tobytes()
    (tmp_path / _GROUP).write_bytes(data)
    entry = (_GROUP, len(data), crc_hex(crc32c.crc32c(data)))
    with tcp_proxy(raw.endpoint) as proxy:
        store = proxied(raw, proxy)
        url = store.root()
        layout = RemoteLayout(url, store.options, transfer=CFG)
        key = layout.step_key

        def copied(layout: RemoteLayout, src: int, dst: int) -> tuple[list[str], int]:
            proxy.reset_counts()
            return layout.copy_files(src, key(dst), [entry]), proxy.down

        layout.put_files(key(1), [(str(tmp_path / _GROUP), *entry)])
        assert copied(layout, 1, 2) == ([], pytest.approx(0, abs=len(data) // 8))  # from what it wrote
        assert copied(layout, 2, 3) == ([], pytest.approx(0, abs=len(data) // 8))  # from what it copied
        _alter_in_place(raw, posixpath.join(key(3), _GROUP))
        assert copied(layout, 3, 4) == ([_GROUP], pytest.approx(0, abs=len(data) // 8))  # refused by Azure
        assert not raw.fs().exists(posixpath.join(key(4), _GROUP))
        fresh = RemoteLayout(url, store.options, transfer=CFG)  # a new process: nothing proven yet
        failed, down = copied(fresh, 2, 5)
        assert failed == [] and down > len(data)  # read back once ...
        assert copied(fresh, 5, 6) == ([], pytest.approx(0, abs=len(data) // 8))  # ... then known
        assert copied(fresh, 3, 7)[0] == [_GROUP]  # and the altered one is found by reading it
    for step in (2, 5, 6):
        assert raw.fs().cat_file(posixpath.join(key(step), _GROUP)) == data


@pytest.fixture(
    params=[
        "s3-no-crc",
        pytest.param("gs", marks=pytest.mark.slow),
        pytest.param("az", marks=pytest.mark.slow),
    ]
)
def saving(request: pytest.FixtureRequest) -> Iterator[tuple[Store, Store, TcpProxy]]:
    yield from _fixture_store(request)


def test_a_stable_group_altered_in_place_is_never_committed_in_a_new_step(
    saving: tuple[Store, Store, TcpProxy],
) -> None:
    """Direct saves (no local_root): step 3 copies the stable group; it is then altered in place at the
    same size. Step 4 (a new manager) must not list the altered bytes: its copy is refused and the group
    written from memory, so step 4 verifies and restores bit for bit; step 5 copies from step 4 again."""
    store, raw, proxy = saving
    url = store.root()
    model = Frozen()
    layout = RemoteLayout(url, raw.options, transfer=CFG)
    with safepoint.CheckpointManager(url, storage_options=store.options, transfer=CFG) as mgr:
        up = saves_counted(mgr, model, proxy, range(1, 4), wait=True)[0]
    assert up[3] < ADAPTER * 4 + OVERHEAD, up  # the group was copied server-side
    group = next(n for n in layout.read_manifest(3).files if is_stable_group(n))
    _alter_in_place(raw, posixpath.join(layout.step_key(3), group))
    with safepoint.CheckpointManager(url, storage_options=store.options, transfer=CFG) as mgr:
        up, saved = saves_counted(mgr, model, proxy, range(4, 6), wait=True)
        down = proxy.down  # what step 5's save read (its copy read back where the store keeps no crc32c)
    assert up[4] > BASE, up  # the group written again, not copied from the altered one ...
    assert up[5] < ADAPTER * 4 + OVERHEAD, up  # ... and copied from step 4 after that
    # Step 5's copy: on Azure and on S3 without CRC32C proven by the version step 4 wrote (remote/
    # versions.py), on GCS by the store's own crc32c: nothing read back.
    assert down < BASE // 8, (store.scheme, down)
    for step in (4, 5):
        layout.verify(step)
        fresh = Frozen()
        with safepoint.CheckpointManager(url, storage_options=raw.options, transfer=CFG) as mgr:
            assert mgr.restore(safepoint.TrainState(model=fresh), step=step) == step
        assert torch.equal(fresh.base, saved[step]["base"])
        assert torch.equal(fresh.adapter, saved[step]["adapter"])


def test_proven_versions_are_bounded_and_bound_to_size_and_crc() -> None:
    """The remembered versions stay bounded (the oldest go first: such a group is read back once more), a
    version vouches only for the size and crc32c it was proven with, and a path written again is forgotten
    until its new version is proven."""
    from safepoint.remote.versions import ProvenVersions

    known = ProvenVersions(limit=2)
    known.remember("a", '"1"', 10, "00000001")
    known.remember("b", '"2"', 10, "00000002")
    assert known.tag("a", 10, "00000001") == '"1"'
    assert known.tag("a", 10, "00000002") is None and known.tag("a", 11, "00000001") is None
    known.remember("c", '"3"', 10, "00000003")  # over the limit: "a", the oldest, goes
    assert known.tag("a", 10, "00000001") is None and known.tag("c", 10, "00000003") == '"3"'
    known.remember("b", None, 10, "00000002")  # written again, no version known: forgotten
    assert known.tag("b", 10, "00000002") is None


def test_a_replacement_finished_from_a_staged_copy_altered_in_place_is_never_committed(
    tmp_path: Path, stores: tuple[Store, Store, TcpProxy]
) -> None:
    """A re-save of a committed step (``overwrite=True``) is staged under .pending, then copied over the
    step server-side (RemoteLayout._promote); a process that died midway leaves the staged copy for the
    next owner to finish the job with (``_roll_forward``). That owner proved no version of the staged
    objects: where the store keeps no crc32c, its copies must be proven like any other (read back), not
    taken by their size, or a staged object altered in place at the same size is committed as step 3."""
    from safepoint.store.manifest import FileEntry, Manifest

    store, raw, _ = stores
    url = store.root()
    data = torch.randn(MiB // 2).numpy().tobytes()
    (tmp_path / _GROUP).write_bytes(data)
    entry = (_GROUP, len(data), crc_hex(crc32c.crc32c(data)))
    manifest = Manifest(step=3, files={_GROUP: FileEntry(size=entry[1], crc32c=entry[2])})
    writer = RemoteLayout(url, store.options, transfer=CFG)
    staged = writer._p(".pending", "step-3-abc123")
    writer.put_files(staged, [(str(tmp_path / _GROUP), *entry)])
    _alter_in_place(raw, posixpath.join(staged, _GROUP))  # after the writer died, before the promotion
    owner = RemoteLayout(url, store.options, transfer=CFG)  # a new process: nothing proven yet
    with pytest.raises(safepoint.UploadError, match="contents altered"):
        owner._promote(staged, manifest)
    assert not raw.fs().exists(posixpath.join(owner.step_key(3), "safepoint.json"))
    assert owner._unfinished == {staged: manifest}  # kept: finished only once its copy is proven


def test_a_new_owner_proves_a_staged_copy_before_it_finishes_a_replacement_with_it(
    tmp_path: Path, stores: tuple[Store, Store, TcpProxy]
) -> None:
    """``clean_pending`` finds a staged re-save of step 3 whose promotion never started (no step-3 manifest):
    it proves the staged objects (read back where the store keeps no crc32c) before promoting them. One
    altered in place at the same size makes the staged copy unusable: removed, step 3 never committed."""
    from safepoint.store.manifest import FileEntry, Manifest

    store, raw, _ = stores
    url = store.root()
    data = torch.randn(MiB // 2).numpy().tobytes()
    (tmp_path / _GROUP).write_bytes(data)
    entry = (_GROUP, len(data), crc_hex(crc32c.crc32c(data)))
    meta = b"not read here"
    (tmp_path / ".metadata").write_bytes(meta)
    head = (".metadata", len(meta), crc_hex(crc32c.crc32c(meta)))
    files = {name: FileEntry(size=size, crc32c=crc) for name, size, crc in (entry, head)}
    manifest = Manifest(step=3, files=files)
    writer = RemoteLayout(url, store.options, transfer=CFG)
    staged = writer._p(".pending", "step-3-abc123")
    writer.put_files(staged, [(str(tmp_path / e[0]), *e) for e in (entry, head)])
    writer.store.put_bytes(posixpath.join(staged, "safepoint.json"), manifest.to_json())
    _alter_in_place(raw, posixpath.join(staged, _GROUP))
    owner = RemoteLayout(url, store.options, transfer=CFG)  # a new process: nothing proven yet
    assert owner.clean_pending() == ["removed abandoned .pending/step-3-abc123"]
    assert owner.committed_steps() == [] and owner._unfinished == {}
    assert not raw.fs().exists(posixpath.join(owner.step_key(3), _GROUP))


def test_dcps_metadata_rename_is_a_proven_copy(stores: tuple[Store, Store, TcpProxy]) -> None:
    """DCP writes .metadata.tmp and renames it: on a store, a server-side copy. It is proven to hold the
    bytes this writer streamed (their recorded size and crc32c) like any copy, so a .metadata.tmp altered
    in place at the same size before the rename makes the rename fail (the save then fails) and leaves no
    .metadata: never committed by its size where the store keeps no crc32c."""
    from safepoint.remote.io import _StoreFileSystem
    from safepoint.store.checksum import ChecksumRecorder

    store, raw, _ = stores
    layout = RemoteLayout(store.root(), store.options, transfer=CFG)
    dcp_fs = _StoreFileSystem(layout.store, ChecksumRecorder())
    prefix = layout.step_key(1)
    body = torch.randn(64 * 1024).numpy().tobytes()
    for name in ("a.tmp", "b.tmp"):
        with dcp_fs.create_stream(posixpath.join(prefix, name), "wb") as out:
            out.write(body)
    dcp_fs.rename(posixpath.join(prefix, "a.tmp"), posixpath.join(prefix, "a"))
    assert raw.fs().cat_file(posixpath.join(prefix, "a")) == body
    _alter_in_place(raw, posixpath.join(prefix, "b.tmp"))
    with pytest.raises(safepoint.UploadError, match="contents altered|ConditionNotMet"):  # Azure refuses
        dcp_fs.rename(posixpath.join(prefix, "b.tmp"), posixpath.join(prefix, "b"))
    assert not raw.fs().exists(posixpath.join(prefix, "b"))


def test_a_new_owner_proves_a_staged_multipart_upload_by_its_composite_checksum_without_a_read(
    tmp_path: Path, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On S3 a staged object uploaded in parts has a composite CRC32C that the parts the manifest records
    vouch for (as ``check`` uses it): proving the staged copy before promoting it reads none of its bytes
    (read back whole before: ``prove`` ignored the parts)."""
    from safepoint.store.manifest import FileEntry, Manifest

    raw = s3_store(moto_endpoint)
    data = torch.randn(3 * MiB).numpy().tobytes()  # 12 MiB: three parts of 5 MiB, a composite CRC32C
    meta = b"not read here"
    (tmp_path / _GROUP).write_bytes(data)
    (tmp_path / ".metadata").write_bytes(meta)
    entries = [(n, len(b), crc_hex(crc32c.crc32c(b))) for n, b in ((_GROUP, data), (".metadata", meta))]
    with tcp_proxy(raw.endpoint) as proxy:
        store = proxied(raw, proxy)
        url = store.root()
        writer = RemoteLayout(url, store.options, transfer=CFG)
        staged = writer._p(".pending", "step-3-abc123")
        parts = writer.put_files(staged, [(str(tmp_path / e[0]), *e) for e in entries])
        assert _GROUP in parts  # uploaded in parts, its composite checksum recorded
        files = {n: FileEntry(size=s, crc32c=c, parts=parts.get(n)) for n, s, c in entries}
        writer.store.put_bytes(
            posixpath.join(staged, "safepoint.json"), Manifest(step=3, files=files).to_json()
        )
        owner = RemoteLayout(url, store.options, transfer=CFG)
        reads: list[str] = []
        real = owner.store.call  # type: ignore[attr-defined]

        async def call(method: str, **kw: Any) -> Any:
            if method == "get_object":
                reads.append(str(kw["Key"]))
            return await real(method, **kw)

        monkeypatch.setattr(owner.store, "call", call)
        assert owner.clean_pending() == ["finished the interrupted replacement of step-3"]
        # Listed through the proxy while it still runs: ``owner`` reaches the store only through it (after
        # the block a listing worked only on a pooled keep-alive connection, and failed in CI when the pool
        # had dropped it: "Could not connect").
        assert owner.committed_steps() == [3]
    # The staged object: vouched by its parts, no byte read. (Its promoted copy is read back here: moto
    # labels the CRC32C it computes of a copy COMPOSITE, where S3 gives a full-object one.)
    assert not [k for k in reads if "/.pending/" in k and k.endswith(_GROUP)], reads
    assert raw.fs().cat_file(posixpath.join(owner.step_key(3), _GROUP)) == data
