"""One multipart upload per page of ``ListMultipartUploads``: S3 pages its listing (at most 1,000 uploads each,
``IsTruncated`` and the next markers); moto answers every upload at once and ignores the markers. The fault
proxy (tests/helpers/s3.py, rule ``one-upload-per-page``) rewrites moto's real answer into the page a
request's ``key-marker`` and ``upload-id-marker`` ask for, so a client's paging is tested against S3's
paging rules with a store behind it."""

from __future__ import annotations

import urllib.parse
import xml.etree.ElementTree as ET

_NS = "http://s3.amazonaws.com/doc/2006-03-01/"


def _tag(name: str) -> str:
    return f"{{{_NS}}}{name}"


def one_upload_per_page(path: str, data: bytes) -> bytes:
    """moto's answer to the listing ``path`` cut down to the one upload after the request's markers."""
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query, keep_blank_values=True)
    key_marker = query.get("key-marker", [""])[0]
    id_marker = query.get("upload-id-marker", [""])[0]
    ET.register_namespace("", _NS)
    root = ET.fromstring(data)
    # S3 orders a listing by key (then by when each upload began; here by its id) and a page starts after
    # the markers' place in that order, whether or not that upload still exists (ours abort as they go).
    uploads = sorted(
        root.findall(_tag("Upload")),
        key=lambda u: (u.findtext(_tag("Key"), ""), u.findtext(_tag("UploadId"), "")),
    )
    pairs = [(u.findtext(_tag("Key"), ""), u.findtext(_tag("UploadId"), "")) for u in uploads]
    start = next((i for i, pair in enumerate(pairs) if pair > (key_marker, id_marker)), len(pairs))
    for u in root.findall(_tag("Upload")):
        root.remove(u)
    if start < len(pairs):
        root.append(uploads[start])
    truncated = start + 1 < len(pairs)
    for name in ("IsTruncated", "NextKeyMarker", "NextUploadIdMarker"):
        for old in root.findall(_tag(name)):
            root.remove(old)
    ET.SubElement(root, _tag("IsTruncated")).text = "true" if truncated else "false"
    if truncated:
        ET.SubElement(root, _tag("NextKeyMarker")).text = pairs[start][0]
        ET.SubElement(root, _tag("NextUploadIdMarker")).text = pairs[start][1]
    return b'<?xml version="1.0" encoding="UTF-8"?>' + ET.tostring(root)
