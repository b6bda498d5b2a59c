"""botocore's data files (endpoints.json, S3's service model and rule set, ...), parsed once per process
instead of once per botocore session.

Why: every s3fs filesystem opens an aiobotocore session of its own, and each session's loader parses those
files again (~0.1-0.3 s of CPU per session, JSON into OrderedDicts): profiled with py-spy, ~12 % of the CPU
of tests/remote's S3 files, and the same again in every forked torture child that opens a session. botocore
already shares what one loader parsed between all the clients of its session (``instance_cache``): the
parsed data is read, never changed, by what uses it, so sessions can share it the same way. Only the parsing
is shared: every session, client, request and retry stays real.

Used by the moto fixture (tests/helpers/s3.py, for the test process) and the torture zygote
(tests/torture/scenarios.py ``warm_up``: parsed before the fork, so its children inherit it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MISSING = object()


def share(set_attr: Callable[[Any, str, Any], None] = setattr) -> None:
    """Make botocore's ``JSONFileLoader.load_file`` parse each file once for this process (``set_attr``:
    ``setattr``, or a ``MonkeyPatch``'s, which undoes it)."""
    from botocore import loaders

    real = loaders.JSONFileLoader.load_file
    if getattr(real, "shared", False):
        return
    parsed: dict[str, Any] = {}

    def load_file(self: Any, file_path: str) -> Any:
        data = parsed.get(file_path, _MISSING)
        if data is _MISSING:
            data = parsed.setdefault(file_path, real(self, file_path))
        return data

    load_file.shared = True  # type: ignore[attr-defined]
    set_attr(loaders.JSONFileLoader, "load_file", load_file)


def preload() -> None:
    """Parse what an S3 client of any session loads (its creation sends no request)."""
    import botocore.session

    share()
    session = botocore.session.get_session()
    session.create_client("s3", region_name="us-east-1", endpoint_url="http://127.0.0.1:9")
