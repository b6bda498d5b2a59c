"""The one validating reader for every JSON record safepoint reads from a root (issue 23).

Manifests, peer replica records (``.peers/step-N/replica.json``), leases, the run history
(``.attempts.json``), upload history (``.uploads.json``): all are parsed here, because ``json.loads``
accepts what no writer of ours ever writes and what the code after it cannot take:

- ``NaN``/``Infinity``/``1e400`` (non-finite numbers): ``json.dumps(allow_nan=False)`` then raises (the
  manifest's self-checksum), and a comparison with NaN is always False (retention, staleness);
- 2,000-deep nesting: ``RecursionError`` in the decoder or in whatever walks the result;
- a number of 5,000 digits (ValueError), ``2**63`` as a time (``datetime`` overflows), a pid of ``10**30``
  (``os.kill`` overflows) or ``-1`` (``kill(-1, 0)`` reaches every process: "alive" forever);
- ``[]`` where an object is expected (``AttributeError`` on ``.get``).

Everything wrong becomes :class:`CorruptRecordError`, one line that names the record: callers turn it into
"corrupt: warn, fall back" (a checkpoint), "advisory file ignored" (history) or "cannot judge" (a lease).
Range checks are per field (:func:`int_field`, :func:`float_field`, ...), with the bounds the reader needs.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, NoReturn

from safepoint.errors import CheckpointError
from safepoint.store.guard import read_regular

MAX_DEPTH = 32
"""Deepest nesting of arrays/objects accepted in any record (ours nest 4 levels at most)."""
MAX_RECORD_BYTES = 64 * 1024 * 1024
"""Largest record read at all (a manifest of 100,000 files is ~10 MB); each reader may pass a smaller cap."""
MAX_INT = 2**62
"""The largest integer any field may hold (sizes, steps, offsets): far below where C code overflows."""
_SHOWN = 60


class CorruptRecordError(CheckpointError):
    """A record that does not parse as one we write: ``what`` names it (a path, or 'step 3 manifest')."""

    def __init__(self, what: str, reason: str) -> None:
        self.what = what
        self.reason = " ".join(reason.split())  # one line, whatever the cause's message held
        super().__init__(f"{what}: {self.reason}")


def shown(value: object) -> str:
    """``value``'s repr, cut short: a hostile record's field may be megabytes long."""
    text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[: _SHOWN - 3]}..."


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"non-finite number {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses as inf
        raise ValueError(f"number {text[:_SHOWN]} is out of range")
    return value


def _depth_problem(value: Any, max_depth: int) -> str | None:
    """Why ``value`` nests deeper than ``max_depth`` (walked without recursion), or None."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth >= max_depth:
            return f"nested deeper than {max_depth} levels"
        stack.extend((c, depth + 1) for c in children)
    return None


def parse_json(data: bytes | str, what: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """``data`` parsed: finite numbers only, nested ``max_depth`` levels at most, within
    :data:`MAX_RECORD_BYTES`. Raises :class:`CorruptRecordError` naming ``what``."""
    if len(data) > MAX_RECORD_BYTES:
        raise CorruptRecordError(what, f"larger than {MAX_RECORD_BYTES} bytes")
    try:
        value = json.loads(data, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise CorruptRecordError(what, f"nested deeper than {max_depth} levels") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, too many digits, our own rejections
        raise CorruptRecordError(what, f"not a valid record ({e})") from None
    if (problem := _depth_problem(value, max_depth)) is not None:
        raise CorruptRecordError(what, problem)
    return value


def parse_object(data: bytes | str, what: str, *, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """:func:`parse_json`, and the result must be a JSON object."""
    value = parse_json(data, what, max_depth=max_depth)
    if not isinstance(value, dict):
        raise CorruptRecordError(what, f"a JSON {_kind(value)}, not an object")
    return value


def read_record(path: str | os.PathLike[str], limit: int = MAX_RECORD_BYTES) -> dict[str, Any]:
    """The JSON object in the regular file ``path`` (no symlink, FIFO or device: guard.read_regular), at
    most ``limit`` bytes. OSError (FileNotFoundError when absent) as raised; CorruptRecordError otherwise."""
    return parse_object(read_regular(path, limit), os.fspath(path))


def _kind(value: object) -> str:
    return {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        int: "number",
        float: "number",
    }.get(type(value), "null")


_MISSING: Any = object()


def _get(rec: dict[str, Any], key: str, default: Any, what: str) -> Any:
    if key in rec:
        return rec[key]
    if default is _MISSING:
        raise CorruptRecordError(what, f"has no {key!r}")
    return default


def int_field(
    rec: dict[str, Any], key: str, what: str, *, lo: int = 0, hi: int = MAX_INT, default: Any = _MISSING
) -> Any:
    """``rec[key]``: an integer (not a bool, not 1.0) in ``[lo, hi]``; ``default`` when absent, if given."""
    value = _get(rec, key, default, what)
    if key not in rec:
        return value
    if type(value) is not int or not lo <= value <= hi:
        raise CorruptRecordError(what, f"{key} {shown(value)} is not an integer in [{lo}, {hi}]")
    return value


def float_field(
    rec: dict[str, Any], key: str, what: str, *, lo: float, hi: float, default: Any = _MISSING
) -> Any:
    """``rec[key]``: a finite number in ``[lo, hi]`` (as a float); ``default`` when absent, if given."""
    value = _get(rec, key, default, what)
    if key not in rec:
        return value
    return checked_float(value, key, what, lo=lo, hi=hi)


def checked_float(value: object, name: str, what: str, *, lo: float, hi: float) -> float:
    """``value`` as a float if it is a finite number (not a bool) in ``[lo, hi]``."""
    if type(value) not in (int, float) or not lo <= value <= hi:  # type: ignore[operator]
        raise CorruptRecordError(what, f"{name} {shown(value)} is not a number in [{lo:g}, {hi:g}]")
    return float(value)  # type: ignore[arg-type]


def str_field(
    rec: dict[str, Any], key: str, what: str, *, max_len: int = 4096, default: Any = _MISSING
) -> Any:
    """``rec[key]``: a string of at most ``max_len`` characters; ``default`` when absent, if given."""
    value = _get(rec, key, default, what)
    if key not in rec:
        return value
    if not isinstance(value, str) or len(value) > max_len:
        raise CorruptRecordError(what, f"{key} {shown(value)} is not a string of <= {max_len} characters")
    return value


def dict_field(rec: dict[str, Any], key: str, what: str, *, default: Any = _MISSING) -> Any:
    """``rec[key]``: a JSON object; ``default`` when absent, if given."""
    value = _get(rec, key, default, what)
    if key not in rec:
        return value
    if not isinstance(value, dict):
        raise CorruptRecordError(what, f"{key} is a JSON {_kind(value)}, not an object")
    return value


def list_field(rec: dict[str, Any], key: str, what: str, *, default: Any = _MISSING) -> Any:
    """``rec[key]``: a JSON array; ``default`` when absent, if given."""
    value = _get(rec, key, default, what)
    if key not in rec:
        return value
    if not isinstance(value, list):
        raise CorruptRecordError(what, f"{key} is a JSON {_kind(value)}, not an array")
    return value
