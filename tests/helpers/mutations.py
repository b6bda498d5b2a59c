"""What a request changes in a store: S3, GCS (JSON API) and Azure Blob requests, read off the wire.

The fault proxy (tests/helpers/s3.py) counts every mutation a client sends, whichever store is behind it;
this names each one in the same words for the three stores, and the object it changes as ``/bucket/key``:

    put            S3 PUT; GCS upload (multipart); Azure Put Blob
    part           S3 upload-part; GCS resumable upload data (the last completes it); Azure Put Block
    copy           S3 PUT with x-amz-copy-source; GCS rewrite/copy; Azure Put Blob with x-ms-copy-source
    mpu-create     S3 multipart create; GCS resumable upload start
    mpu-complete   S3 multipart complete; Azure Put Block List
    mpu-abort      S3 multipart abort
    delete         one DELETE
    delete-batch   S3 DeleteObjects; GCS batch; Azure blob batch (``keys``: every object deleted)

``read_kind`` names the requests that only read, in the same way (the read-fault campaign counts them):

    get            an object's bytes (S3 GET, GCS ``alt=media``, Azure Get Blob), ranged or whole
    head           an object's metadata (S3 HEAD, GCS object resource, Azure Get Blob Properties)
    list           a listing (S3 ListObjectsV2 and ListMultipartUploads, GCS objects.list, Azure List Blobs)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit


@dataclass
class Mutation:
    kind: str
    key: str
    keys: list[str] = field(default_factory=list)


def parse(method: str, path: str, headers: Any, body: bytes) -> Mutation | None:
    """The mutation a request makes, or None if it only reads."""
    if headers.get("x-ms-version"):
        return _azure(method, path, headers, body)
    if path.startswith(("/upload/storage/v1/", "/storage/v1/", "/batch/storage/v1")):
        return _gcs(method, path, body)
    return _s3(method, path, headers, body)


def _s3(method: str, path: str, headers: Any, body: bytes) -> Mutation | None:
    query = path.partition("?")[2]
    params = {p.split("=", 1)[0] for p in query.split("&") if p}
    key = path.split("?")[0]
    kind: str | None = None
    if method == "PUT":
        kind = "copy" if headers.get("x-amz-copy-source") else "part" if "partNumber" in params else "put"
    elif method == "POST":
        if "uploads" in params:
            kind = "mpu-create"
        elif "uploadId" in params:
            kind = "mpu-complete"
        elif "delete" in params:
            keys = [f"/{key.strip('/')}/{k.decode()}" for k in re.findall(rb"<Key>(.*?)</Key>", body)]
            return Mutation("delete-batch", key, keys)
        else:
            kind = "post"
    elif method == "DELETE":
        kind = "mpu-abort" if "uploadId" in params else "delete"
    return Mutation(kind, key) if kind else None


_GCS_OBJECT = re.compile(r"^/storage/v1/b/([^/]+)/o/([^/]+)$")
_GCS_COPY = re.compile(r"^/storage/v1/b/[^/]+/o/[^/]+/(?:rewriteTo|copyTo)/b/([^/]+)/o/([^/]+)$")
_GCS_BATCH_DELETE = re.compile(rb"DELETE (?:https?://[^/\s]+)?/storage/v1/b/([^/\s]+)/o/([^?\s]+)")


def _gcs(method: str, path: str, body: bytes) -> Mutation | None:
    u = urlsplit(path)
    q = {k: v[0] for k, v in parse_qs(u.query).items()}
    if u.path.startswith("/upload/storage/v1/b/"):
        bucket = unquote(u.path.split("/")[5])
        name = q.get("name") or _json_name(body)
        key = f"/{bucket}/{name}"
        if "upload_id" in q:  # the data of a resumable upload (its last request completes it)
            return Mutation("part", key)
        if method == "POST":
            return Mutation("mpu-create" if q.get("uploadType") == "resumable" else "put", key)
        if method == "PUT":
            return Mutation("part", key)
        return None
    if u.path.startswith("/batch/"):
        keys = [f"/{unquote(b.decode())}/{unquote(o.decode())}" for b, o in _GCS_BATCH_DELETE.findall(body)]
        return Mutation("delete-batch", keys[0] if keys else u.path, keys) if keys else None
    if method == "POST" and (m := _GCS_COPY.match(u.path)):
        return Mutation("copy", f"/{unquote(m.group(1))}/{unquote(m.group(2))}")
    if method == "DELETE" and (m := _GCS_OBJECT.match(u.path)):
        return Mutation("delete", f"/{unquote(m.group(1))}/{unquote(m.group(2))}")
    return None


def _json_name(body: bytes) -> str:
    """The object's name from an upload's metadata (the JSON part of a multipart/related body)."""
    m = re.search(rb'\{[^{}]*"name"[^{}]*\}', body[:65536])
    if not m:
        return "?"
    try:
        return str(json.loads(m.group(0))["name"])
    except (ValueError, KeyError):
        return "?"


def _azure(method: str, path: str, headers: Any, body: bytes) -> Mutation | None:
    u = urlsplit(path)
    q = {k: v[0] for k, v in parse_qs(u.query).items()}
    # Path-style (Azurite): /<account>/<container>/<blob>; the account is dropped.
    key = "/" + unquote(u.path).strip("/").partition("/")[2]
    if q.get("restype") == "container" and q.get("comp") != "batch":
        return None  # the container itself (create, delete, properties)
    if method == "PUT":
        comp = q.get("comp")
        if comp == "block":
            return Mutation("part", key)
        if comp == "blocklist":
            return Mutation("mpu-complete", key)
        if comp is None:
            return Mutation("copy" if headers.get("x-ms-copy-source") else "put", key)
        if comp == "lease" and headers.get("x-ms-lease-action") == "renew":
            # A block upload's lease is renewed in the background every 15 s (remote/azlease.py): when, and
            # so how many, depends on timing, and it changes nothing in the store. Not counted, so that the
            # mutations of two runs line up.
            return None
        return Mutation(f"put-{comp}", key)
    if method == "DELETE":
        return Mutation("delete", key)
    if method == "POST" and q.get("comp") == "batch":
        found = re.findall(rb"DELETE (/[^?\s]+)", body)
        keys = []
        for p in found:
            parts = unquote(p.decode()).strip("/").split("/")
            # A batch names blobs as /<container>/<blob> or /<account>/<container>/<blob>.
            rest = parts[1:] if key.strip("/") and parts[0] != key.strip("/").split("/")[0] else parts
            keys.append("/" + "/".join(rest))
        return Mutation("delete-batch", keys[0] if keys else key, keys) if keys else None
    return None


def read_kind(method: str, path: str, headers: Any) -> str | None:
    """``get``, ``head`` or ``list`` for a request that only reads (None: a mutation or something else)."""
    if method not in ("GET", "HEAD"):
        return None
    u = urlsplit(path)
    q = parse_qs(u.query, keep_blank_values=True)
    if headers.get("x-ms-version"):
        return "list" if q.get("comp") == ["list"] else "head" if method == "HEAD" else "get"
    if u.path.startswith(("/storage/v1/", "/download/storage/v1/")):
        if method == "GET" and re.match(r"^/storage/v1/b/[^/]+/o/?$", u.path):
            return "list"
        media = u.path.startswith("/download/") or q.get("alt") == ["media"]
        return "get" if media else "head"
    if method == "HEAD":
        return "head"
    key = u.path.strip("/")
    if "/" not in key or "list-type" in q or "uploads" in q:  # a bucket-level GET: a listing
        return "list"
    return "get"
