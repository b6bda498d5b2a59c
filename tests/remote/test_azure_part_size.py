"""A ``part_size`` above azure-storage-blob's own single-put limit (64 MiB): a file between the two went up as
one ``upload_blob`` call, which the SDK split into blocks itself, sending our whole-body Content-MD5 with
each: Azure refused every such upload (Md5Mismatch). Now such a body goes up as our own blocks, each with
its own Content-MD5, through both upload paths (a local file, and DCP's stream to the store). Azurite."""

from __future__ import annotations

import os
from pathlib import Path

import crc32c

from safepoint.remote.azstore import AzureStore
from safepoint.remote.upload import FileCopy, MiB, TransferOptions
from tests.helpers.stores import azure_store

SDK_SINGLE_PUT = 64 * MiB  # azure-storage-blob's default max_single_put_size (adlfs keeps it)


def test_a_body_over_the_sdks_single_put_limit_goes_up_in_checked_blocks(
    azurite_endpoint: str, tmp_path: Path
) -> None:
    import adlfs
    from azure.storage.blob import BlobServiceClient

    raw = azure_store(azurite_endpoint)
    fs = adlfs.AzureBlobFileSystem(skip_instance_cache=True, **raw.options)
    store = AzureStore(fs, TransferOptions(part_size=SDK_SINGLE_PUT + 16 * MiB, attempts=1))
    data = os.urandom(SDK_SINGLE_PUT + 3)  # over the SDK's limit, under part_size
    crc = f"{crc32c.crc32c(data):08x}"
    container = raw.make_bucket()
    local = tmp_path / "big.bin"
    local.write_bytes(data)
    store.put_files([FileCopy(str(local), f"{container}/file.bin", len(data), crc)])
    w = store.open_writer(f"{container}/stream.bin")  # DCP's path: written as it is produced
    for off in range(0, len(data), 8 * MiB):
        w.write(data[off : off + 8 * MiB])
    w.close()
    other = BlobServiceClient.from_connection_string(raw.options["connection_string"])
    for name in ("file.bin", "stream.bin"):
        assert store.check(f"{container}/{name}", len(data), crc) is None
        blocks, _ = other.get_blob_client(container, name).get_block_list("committed")
        assert [b.size for b in blocks] == [SDK_SINGLE_PUT, 3]  # our blocks, not the SDK's
