"""retry: which store errors are worth retrying, backoff with jitter, and the transfer settings.

Every request (a whole file on a generic store, a part on S3) is retried on transient errors (throttling,
5xx, timeouts, connection resets) with exponential backoff and jitter; after the last attempt an
``UploadError`` names what failed, the number of attempts and the last error. Errors that retrying cannot
fix (access denied, no such bucket, a local file that no longer matches its manifest) fail at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from safepoint.errors import SaveError

log = logging.getLogger("safepoint")
T = TypeVar("T")
MiB = 1024 * 1024

# Error codes S3 and S3-compatible stores use for "try again" (throttling, overload, internal trouble).
# BadDigest: the body arrived altered in transit; resending fixes it.
_RETRY_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "BadDigest",
        "XAmzContentSHA256Mismatch",
        "OperationAborted",
    }
)
# Azure's: the same, and a block whose Content-MD5 (or CRC64) did not match the bytes that arrived.
_AZURE_RETRY_CODES = frozenset(
    {"ServerBusy", "OperationTimedOut", "InternalError", "Md5Mismatch", "Crc64Mismatch", "InvalidMd5"}
)
# Exception classes (by name, so no client library is imported here) that mean the connection failed.
_TRANSIENT_CLASSES = frozenset(
    {
        "HTTPClientError",  # botocore: EndpointConnectionError, ConnectionClosedError, ReadTimeoutError ...
        "ClientConnectionError",  # aiohttp: ServerDisconnectedError, ClientOSError ...
        "ClientPayloadError",
        "ServerTimeoutError",
        "IncompleteRead",
        "ResponseStreamingError",
        "FSTimeoutError",
        "ServiceRequestError",  # azure.core: the request never reached the service, or its answer was lost
        "ServiceResponseError",
    }
)
_TRANSIENT_ERRNOS = frozenset(
    {errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE, errno.EBUSY}
    | {errno.EAGAIN, errno.EREMOTEIO}
)


class UploadError(SaveError):
    """Copying a checkpoint to (or from) the durable tier failed; nothing was committed there."""


class DamagedInTransit(Exception):
    """The store's checksum of what it received differs from ours of what was sent: the body was damaged on
    the way (a bad link, a faulty proxy). Transient: the whole file is sent again, and after the last
    attempt the upload fails (as an UploadError), so a damaged object is never taken as uploaded."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TransferOptions:
    """How files move between tiers."""

    concurrency: int = 10
    """Requests in flight at once per process (parts of big files and small files alike)."""
    part_size: int = 8 * MiB
    """Files above this go up as multipart uploads of parts this big (S3 needs at least 5 MiB)."""
    attempts: int = 5
    """Tries per request before giving up (1 = no retries)."""
    backoff_s: float = 0.25
    """Delay before the first retry; doubles with every further attempt (with jitter)."""
    max_backoff_s: float = 10.0
    client_retries: int | None = None
    """How many times the store's client library retries a failed request by itself, inside each of the
    ``attempts`` above. None (default): the library's own policy, which on GCS and Azure waits long before
    safepoint hears of an error (gcsfs: 5 retries 1 to 17 s apart, ~35 s; the Azure SDK: 3 retries 15, 18
    and 24 s apart, ~60 s; botocore: what ``config_kwargs`` says). A number sets it on every store (gcsfs,
    the Azure SDK, botocore's ``total_max_attempts``); 0 leaves every retry to safepoint (``attempts``,
    ``backoff_s``), so a store that stays down fails a save in seconds rather than minutes. One exception:
    on a gs:// root without ``local_root``, DCP's streamed writes go through gcsfs's resumable upload,
    which only gcsfs retries; keep at least 1 there, or one ``503`` fails that save."""
    full_object_checksum: bool | None = None
    """Which CRC32C an S3 multipart upload leaves on the object. None (default): a *composite* one (S3's
    crc32c of the parts' crc32cs) for uploads of local files, whose parts' crc32cs go into the manifest so
    that a later verify still needs no download, and a full-object one for DCP's streamed writes (no local
    tier). True: full-object everywhere (S3 also checks the assembled object; slower on moto). False:
    composite everywhere, for S3-compatible stores without full-object checksums (a streamed object is then
    verified by reading it). Every part is checked by the store either way."""
    background: bool = False
    """Run the transfer threads at a lower CPU priority (tiering's uploads yield to the training loop)."""

    def __post_init__(self) -> None:
        for name in ("concurrency", "part_size", "attempts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.part_size < 5 * MiB:
            raise ValueError(f"part_size must be at least 5 MiB (S3's minimum part), got {self.part_size}")
        if self.full_object_checksum not in (None, True, False):
            raise ValueError(
                f"full_object_checksum must be None, True or False, got {self.full_object_checksum!r}"
            )
        retries = self.client_retries
        if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int) or retries < 0):
            raise ValueError(f"client_retries must be None or an int >= 0, got {retries!r}")
        if self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError("need 0 <= backoff_s <= max_backoff_s")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based): half fixed, half random.

        The random half spreads the retries of many ranks hitting the same throttled prefix.
        """
        cap = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
        return float(cap / 2 + random.uniform(0, cap / 2))


def lower_priority(nice: int = 10) -> None:
    """Make the calling thread yield the CPU to the training loop when both want it.

    Linux keeps a nice value per thread; raising it needs no privilege. Elsewhere this does nothing.
    """
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))


def is_transient(e: BaseException) -> bool:
    """Whether retrying may help: throttling, 5xx, timeouts, resets (looked for along the cause chain)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if _transient_one(cur):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _transient_one(e: BaseException) -> bool:
    if isinstance(e, UploadError):
        return False
    if isinstance(e, DamagedInTransit):
        return True
    status = getattr(e, "status_code", None)  # azure.core's HttpResponseError
    if isinstance(status, int) and type(e).__module__.startswith("azure."):
        code = getattr(e, "error_code", None)
        code = str(getattr(code, "value", code))  # a StorageErrorCode enum, or a plain string
        return code in _AZURE_RETRY_CODES or status in (408, 429) or status >= 500
    code = getattr(e, "code", None)  # gcsfs's HttpError: the status from GCS's JSON error body
    if type(e).__module__.startswith("gcsfs.") and str(code).isdigit():
        return int(str(code)) in (408, 429) or int(str(code)) >= 500
    resp = getattr(e, "response", None)
    if isinstance(resp, dict) and isinstance(resp.get("Error"), dict):  # botocore ClientError
        code = str(resp["Error"].get("Code", ""))
        status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return code in _RETRY_CODES or status in (408, 429) or status >= 500
    if isinstance(e, (TimeoutError, ConnectionError)):
        return True
    if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
        return True
    return any(c.__name__ in _TRANSIENT_CLASSES for c in type(e).__mro__)


def describe(e: BaseException) -> str:
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:  # s3fs raises OSError(EBUSY) from S3's "SlowDown": named
        seen.add(id(cur))
        resp = getattr(cur, "response", None)
        if isinstance(resp, dict) and isinstance(resp.get("Error"), dict):
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return f"{resp['Error'].get('Code')} (HTTP {status}): {resp['Error'].get('Message', '')}".strip()
        cur = cur.__cause__ or cur.__context__
    return f"{type(e).__name__}: {' '.join(str(e).split())}"  # one line (gcsfs: "Forbidden: <path>\n...")


def next_delay(what: str, e: Exception, attempt: int, cfg: TransferOptions) -> float:
    """After failed attempt ``attempt``: the pause before the next one, or the UploadError to raise."""
    if isinstance(e, UploadError):
        raise e
    if not is_transient(e):
        raise UploadError(f"{what} failed: {describe(e)} (not retried: not a transient error)") from e
    if attempt >= cfg.attempts:
        raise UploadError(f"{what} failed after {attempt} attempts; last error: {describe(e)}") from e
    pause = cfg.delay(attempt)
    log.warning(
        "safepoint: %s: %s; retry %d of %d in %.2fs", what, describe(e), attempt, cfg.attempts - 1, pause
    )
    return pause


def retry(what: str, fn: Callable[[], T], cfg: TransferOptions) -> T:
    """Run ``fn``; retry transient failures with backoff; raise UploadError naming ``what`` at the end."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as e:
            time.sleep(next_delay(what, e, attempt, cfg))


async def retry_async(what: str, fn: Callable[[], Awaitable[T]], cfg: TransferOptions) -> T:
    """``retry`` for a coroutine: awaits ``fn()``, pausing with ``asyncio.sleep`` between attempts."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return await fn()
        except Exception as e:
            await asyncio.sleep(next_delay(what, e, attempt, cfg))


def cause_code(e: BaseException) -> str | None:
    """The store's error code (``NoSuchKey``, ``404`` ...) somewhere along the cause chain, if any."""
    cur: BaseException | None = e
    for _ in range(8):
        if cur is None:
            return None
        resp = getattr(cur, "response", None)
        if isinstance(resp, dict) and isinstance(resp.get("Error"), dict):
            return str(resp["Error"].get("Code", ""))
        cur = cur.__cause__
    return None


def empty_if_unsatisfiable(cat: Callable[..., Any], path: str, start: int, end: int) -> bytes:
    """``cat(path, start=start, end=end)`` (a ranged read from 0, never a hostile object of gigabytes
    fetched whole where a small one is all that is valid), or ``b""`` where the store answers "416 Range
    Not Satisfiable": from byte 0 that means an empty object."""
    try:
        return bytes(cat(path, start=start, end=end))
    except Exception as e:
        if start == 0 and _unsatisfiable(e):
            return b""
        raise


def _unsatisfiable(e: BaseException) -> bool:
    """A store's "416 Range Not Satisfiable" (gcsfs's HttpError ``code``, Azure's ``status_code``), along the
    cause chain."""
    cur: BaseException | None = e
    for _ in range(8):
        if cur is None:
            return False
        if 416 in (getattr(cur, "code", None), getattr(cur, "status_code", None)):
            return True
        cur = cur.__cause__ or cur.__context__
    return False
