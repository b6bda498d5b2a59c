"""Multipart uploads a killed writer left open are aborted by the root's owner (``S3Store.abort_uploads``,
called by ``RemoteLayout.clean_pending``): every one under the root, a root at the top of a bucket
included, over as many pages as S3's listing takes, and none outside the root. Against moto (real S3
requests); the paging through the fault proxy, which serves moto's real listing one upload per page."""

from __future__ import annotations

from typing import Any

import pytest

from safepoint.remote.s3store import S3Store
from safepoint.remote.upload import TransferOptions
from tests.helpers.s3 import FaultProxy, storage_options


def _store(endpoint: str) -> S3Store:
    import s3fs

    return S3Store(
        s3fs.S3FileSystem(skip_instance_cache=True, **storage_options(endpoint)), TransferOptions()
    )


def _client(endpoint: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def _open(endpoint: str, bucket: str, keys: list[str]) -> None:
    s3 = _client(endpoint)
    for key in keys:
        s3.create_multipart_upload(Bucket=bucket, Key=key)


def _still_open(endpoint: str, bucket: str) -> list[str]:
    uploads = _client(endpoint).list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    return sorted(u["Key"] for u in uploads)


@pytest.mark.parametrize(
    ("root", "aborted", "left"),
    [
        # The bucket's top: every key is the root's (was: the listing asked for prefix "/" and found none).
        ("", ["c", "run/a", "run/b/c", "runs/d", "x/e"], []),
        ("run", ["run/a", "run/b/c"], ["c", "runs/d", "x/e"]),  # "runs/" is not "run/"
    ],
    ids=["bucket-root", "prefix-root"],
)
def test_the_open_uploads_under_the_root_and_only_those_are_aborted(
    moto_endpoint: str, bucket: str, root: str, aborted: list[str], left: list[str]
) -> None:
    _open(moto_endpoint, bucket, ["run/a", "run/b/c", "runs/d", "x/e", "c"])
    prefix = f"{bucket}/{root}" if root else bucket
    assert _store(moto_endpoint).abort_uploads(prefix) == len(aborted)
    assert _still_open(moto_endpoint, bucket) == left


def test_every_page_of_the_listing_is_aborted(proxy: FaultProxy, moto_endpoint: str, bucket: str) -> None:
    keys = ["run/a", "run/a", "run/b", "run/c/d", "run/e"]  # two uploads of one key: the id marker matters
    _open(moto_endpoint, bucket, [*keys, "other/f"])
    proxy.add("one-upload-per-page", method="GET", path=r"\?uploads")
    assert _store(proxy.endpoint).abort_uploads(f"{bucket}/run") == len(keys)
    assert _still_open(moto_endpoint, bucket) == ["other/f"]
    pages = [
        p for m, p, what in proxy.seen if m == "GET" and "uploads" in p and what == "one-upload-per-page"
    ]
    assert len(pages) == len(keys), pages  # one page per upload, the last one not truncated
