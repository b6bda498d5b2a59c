"""Error replies in each store's own words, for the fault proxy (tests/helpers/s3.py).

A client library reads an error by its store's conventions, so a fault must be answered the way that
store answers, or the client takes it for something else (a 503 with S3's XML body is, to gcsfs, a
503 with an unreadable message; to the Azure SDK, a 503 without its error code):

    S3     an XML ``<Error><Code>`` body: ``503 SlowDown`` (retried), ``403 AccessDenied`` (not)
    GCS    a JSON ``{"error": {"code", "message", "errors": [{"reason"}]}}`` body: ``503 backendError``
           (gcsfs retries it, then raises its ``HttpError``), ``403 forbidden`` (gcsfs raises
           ``OSError("Forbidden: ...")`` at once)
    Azure  an XML ``<Error><Code>`` body and the same code in ``x-ms-error-code``: ``503 ServerBusy``
           (retried by the SDK and safepoint), ``403 AuthorizationPermissionMismatch`` (not)

``NAMES`` holds, per store and error, the words a failed save's message must carry to name the cause.
"""

from __future__ import annotations

import json
from typing import Any

Reply = tuple[int, dict[str, str], bytes]

_S3_XML = '<?xml version="1.0" encoding="UTF-8"?><Error><Code>{}</Code><Message>{}</Message></Error>'
_S3 = {
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "403": (403, "AccessDenied", "Access Denied"),
    # A retried CompleteMultipartUpload whose first attempt S3 applied (its answer lost): the upload is
    # gone because it completed. moto answers such a retry 200 (idempotent), as S3 may, too.
    "NoSuchUpload": (
        404,
        "NoSuchUpload",
        "The specified upload does not exist. The upload ID may be invalid, or the upload may have been "
        "aborted or completed.",
    ),
}
_GCS = {
    "503": (503, "backendError", "We encountered an internal error. Please try again."),
    "403": (403, "forbidden", "safepoint-test does not have storage.objects.create access to the bucket."),
}
_AZURE = {
    "503": (503, "ServerBusy", "The server is busy."),
    "403": (
        403,
        "AuthorizationPermissionMismatch",
        "This request is not authorized to perform this operation using this permission.",
    ),
}
# What a failed save's error must say (any one of them) to name the store's error.
NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "s3": {"503": ("SlowDown",), "403": ("AccessDenied",), "key-errors": ("InternalError",)},
    "gs": {"503": ("503", "internal error"), "403": ("Forbidden",)},
    "az": {"503": ("ServerBusy",), "403": ("AuthorizationPermissionMismatch",)},
}


def store_of(path: str, headers: Any) -> str:
    """Which store a request is for: ``s3``, ``gs`` or ``az`` (as tests/helpers/mutations.py tells)."""
    if headers.get("x-ms-version"):
        return "az"
    if path.startswith(("/upload/storage/v1/", "/storage/v1/", "/batch/storage/v1", "/download/storage/v1/")):
        return "gs"
    return "s3"


def reply(store: str, error: str) -> Reply:
    """(status, headers, body) of ``error`` ("503" or "403") as ``store`` answers it."""
    if store == "gs":
        status, reason, message = _GCS[error]
        body = {"error": {"code": status, "message": message, "errors": [{"reason": reason}]}}
        return status, {"Content-Type": "application/json; charset=UTF-8"}, json.dumps(body).encode()
    if store == "az":
        status, code, message = _AZURE[error]
        xml = _S3_XML.format(code, message).encode()
        return status, {"Content-Type": "application/xml", "x-ms-error-code": code}, xml
    status, code, message = _S3[error]
    return status, {"Content-Type": "application/xml"}, _S3_XML.format(code, message).encode()
