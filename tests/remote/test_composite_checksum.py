"""S3 composite checksums with the parts recorded in the manifest (issue 17, item 5).

Uploads of local files default to S3's composite CRC32C (crc32c of the parts' crc32cs): cheaper for the
store than a full-object one. The parts each upload went up in, with their crc32cs, go into the durable
manifest, so a later verify still checks every object against its manifest entry from one HEAD, without
reading it. These tests run on moto.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
from pathlib import Path
from typing import Any

import crc32c
import pytest

import safepoint
from safepoint.errors import CorruptCheckpointError
from safepoint.remote.object_layout import RemoteLayout
from safepoint.remote.retry import DamagedInTransit
from safepoint.remote.s3read import composite_value
from safepoint.remote.s3store import S3Store, answer_confirms
from safepoint.remote.upload import FileCopy, MiB, TransferOptions, UploadError
from safepoint.store.checksum import crc_hex
from safepoint.store.manifest import MANIFEST_NAME, FileEntry, Manifest, Parts
from tests.helpers.s3 import FaultProxy, storage_options
from tests.helpers.train import Setup

CFG = TransferOptions(part_size=5 * MiB, concurrency=4)


def _fs(endpoint: str) -> Any:
    import s3fs

    return s3fs.S3FileSystem(**storage_options(endpoint), skip_instance_cache=True)


def test_a_composite_object_is_checked_against_its_recorded_parts(
    tmp_path: Path, moto_endpoint: str, bucket: str
) -> None:
    """The upload returns the parts (deterministic: ``part_size``, the last one shorter) with their
    crc32cs; the store's composite value and those parts vouch for the file's crc32c without a read, and a
    wrong part checksum, a wrong part count or a composite value other than the parts make is a mismatch."""
    fs = _fs(moto_endpoint)
    store = S3Store(fs, CFG)
    data = os.urandom(12 * MiB + 3)
    (tmp_path / "big.bin").write_bytes(data)
    crc, path = crc_hex(crc32c.crc32c(data)), f"{bucket}/x/big.bin"
    parts = store.put_files([FileCopy(str(tmp_path / "big.bin"), path, len(data), crc)])
    spans = [data[i : i + 5 * MiB] for i in range(0, len(data), 5 * MiB)]
    assert parts == {path: Parts(size=5 * MiB, crc32c=tuple(crc_hex(crc32c.crc32c(p)) for p in spans))}
    head = fs.call_s3("head_object", Bucket=bucket, Key="x/big.bin", ChecksumMode="ENABLED")
    assert head["ChecksumType"] == "COMPOSITE"
    recorded = parts[path]
    assert store.stored_checksum(path) == (len(data), None)  # without the parts: no file crc32c
    assert store.stored_checksum(path, recorded) == (len(data), crc)
    assert store.check(path, len(data), crc, read=False, parts=recorded) is None
    # Parts that do not make the store's value vouch for nothing: verify reads the bytes instead.
    wrong = dataclasses.replace(recorded, crc32c=(recorded.crc32c[0], "00000000", recorded.crc32c[2]))
    assert store.stored_checksum(path, wrong) == (len(data), None)
    assert store.check(path, len(data), crc, parts=wrong) is None  # read: the bytes are the file's
    assert "crc32c" in (store.check(path, len(data), f"{int(crc, 16) ^ 1:08x}", parts=wrong) or "")
    # A server-side copy (what `aws s3 cp` between buckets, or a copied root, does) is stored in another
    # layout: never reported as damaged; the store's value or the bytes confirm it.
    fs.call_s3(
        "copy_object", Bucket=bucket, Key="x/copy.bin", CopySource={"Bucket": bucket, "Key": "x/big.bin"}
    )
    assert store.check(f"{bucket}/x/copy.bin", len(data), crc, parts=recorded) is None
    # Parts that make the store's value but not the manifest's crc32c (a manifest that contradicts itself).
    assert "crc32c" in (
        store.check(path, len(data), f"{int(crc, 16) ^ 1:08x}", read=False, parts=recorded) or ""
    )
    # The full-object checksum stays an option: then nothing needs recording.
    full = S3Store(fs, dataclasses.replace(CFG, full_object_checksum=True))
    assert full.put_files([FileCopy(str(tmp_path / "big.bin"), f"{bucket}/x/f.bin", len(data), crc)]) == {}
    head = fs.call_s3("head_object", Bucket=bucket, Key="x/f.bin", ChecksumMode="ENABLED")
    assert head["ChecksumType"] == "FULL_OBJECT"


def test_a_tiered_upload_verifies_without_a_download(tmp_path: Path, proxy: FaultProxy, bucket: str) -> None:
    """A checkpoint uploaded by tiering records its objects' parts in the durable manifest; verifying it
    there reads no data object, and a manifest whose recorded part checksum is wrong fails verification."""
    url, opts = f"s3://{bucket}/run", storage_options(proxy.endpoint)
    s = Setup(width=120_000)  # a shard of ~15 MiB: four parts of (up to) 5 MiB
    with safepoint.CheckpointManager(
        url, local_root=tmp_path / "l", storage_options=opts, transfer=CFG
    ) as mgr:
        s.step()
        mgr.save(1, s.state())
        mgr.wait()
    layout = RemoteLayout(url, storage_options(proxy.endpoint), transfer=CFG)
    manifest = layout.read_manifest(1)
    recorded = {n: e.parts for n, e in manifest.files.items() if e.parts is not None}
    assert "__0_0.distcp" in recorded and len(recorded["__0_0.distcp"].crc32c) >= 2
    local = Manifest.from_json((tmp_path / "l" / "step-1" / MANIFEST_NAME).read_bytes())
    assert all(e.parts is None for e in local.files.values()), "local manifests are unchanged"
    proxy.seen.clear()
    layout.verify(1)
    reads = [p for m, p, _ in proxy.seen if m == "GET" and ".distcp" in p]
    assert reads == [], f"verify downloaded {reads}"
    entry = manifest.files["__0_0.distcp"]
    assert entry.parts is not None
    bad = dataclasses.replace(entry.parts, crc32c=("00000000", *entry.parts.crc32c[1:]))
    forged = dataclasses.replace(
        manifest, files={**manifest.files, "__0_0.distcp": dataclasses.replace(entry, parts=bad)}
    )
    layout.store.put_bytes(posixpath.join(layout.step_key(1), MANIFEST_NAME), forged.to_json())
    # A part record that does not make the store's value vouches for nothing: verify reads that object.
    proxy.seen.clear()
    layout.verify(1)
    assert [p for m, p, _ in proxy.seen if m == "GET" and ".distcp" in p], "the object was not read"
    # ... and bytes that do not match the manifest's crc32c are damage, whatever the part record says.
    lying = dataclasses.replace(entry, crc32c=f"{int(entry.crc32c, 16) ^ 1:08x}", parts=bad)
    forged = dataclasses.replace(manifest, files={**manifest.files, "__0_0.distcp": lying})
    layout.store.put_bytes(posixpath.join(layout.step_key(1), MANIFEST_NAME), forged.to_json())
    with pytest.raises(CorruptCheckpointError, match="__0_0.distcp.*crc32c"):
        layout.verify(1)


@pytest.mark.parametrize(
    "parts",
    [Parts(size=0, crc32c=()), Parts(size=4, crc32c=("0000000g",)), Parts(size=4, crc32c=("00000000",))],
    ids=["no-size", "not-hex", "too-few"],
)
def test_malformed_parts_make_a_corrupt_manifest(parts: Parts) -> None:
    files = {
        ".metadata": FileEntry(size=4, crc32c="00000000"),
        "__0_0.distcp": FileEntry(size=8, crc32c="00000000"),
    }
    good = Manifest(
        step=1,
        files={
            **files,
            "__0_0.distcp": dataclasses.replace(
                files["__0_0.distcp"], parts=Parts(size=4, crc32c=("00000000",) * 2)
            ),
        },
    )
    assert Manifest.from_json(good.to_json()).files == good.files
    bad = Manifest(
        step=1, files={**files, "__0_0.distcp": dataclasses.replace(files["__0_0.distcp"], parts=parts)}
    )
    with pytest.raises(CorruptCheckpointError, match="parts|part checksums"):
        Manifest.from_json(bad.to_json())


def test_a_failed_file_stops_the_next_one_overlapping_it(
    tmp_path: Path, moto_endpoint: str, bucket: str
) -> None:
    """Big files go one after another, the next starting while the previous completes: when the first
    fails after its parts went up (its local file no longer matches the manifest), the upload fails and
    no multipart upload is left open, neither the first's nor the one started beside it."""
    fs = _fs(moto_endpoint)
    store = S3Store(fs, CFG)
    items = []
    for name in ("a.bin", "b.bin"):
        data = os.urandom(11 * MiB)
        (tmp_path / name).write_bytes(data)
        crc = crc_hex(crc32c.crc32c(data) ^ (1 if name == "a.bin" else 0))
        items.append(FileCopy(str(tmp_path / name), f"{bucket}/y/{name}", len(data), crc))
    with pytest.raises(UploadError, match="a.bin.*no longer matches"):
        store.put_files(items)
    assert fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) == []
    assert not fs.exists(f"{bucket}/y/a.bin")


def test_a_completion_answer_with_the_composite_value_needs_no_head() -> None:
    """Real S3 answers a composite completion with "<b64>-<parts>" (moto sends none, so there a HEAD
    confirms): the value our parts make confirms the object, any other is damage, another kind is no answer."""
    crcs = [0x12345678, 0x9ABCDEF0, 0x0F0F0F0F]
    value = composite_value(crcs)
    assert answer_confirms({"ChecksumCRC32C": f"{value}-3", "ChecksumType": "COMPOSITE"}, "00000000", crcs)
    assert answer_confirms({"ChecksumCRC32C": f"{value}-3"}, "00000000", crcs)
    with pytest.raises(DamagedInTransit):
        answer_confirms({"ChecksumCRC32C": f"{composite_value(crcs[:2])}-2"}, "00000000", crcs)
    assert not answer_confirms({"ChecksumCRC32C": "AAAAAA==", "ChecksumType": "FULL_OBJECT"}, "0", crcs)
    assert not answer_confirms({"ETag": "x"}, "00000000", crcs)
    with pytest.raises(ValueError, match="full_object_checksum"):
        TransferOptions(full_object_checksum="yes")  # type: ignore[arg-type]
