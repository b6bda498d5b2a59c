"""What restore can load, checked at save time (issue 13, finding 9): every non-tensor item of a captured
state must survive restore's ``torch.load(weights_only=True)``, or the save fails at once naming it (a
checkpoint that cannot be restored is found out only after the crash it was saved for)."""

from __future__ import annotations

import copy
import hashlib
import io
import pickle
import sys
import threading
from collections import OrderedDict
from collections.abc import Mapping
from itertools import chain
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from safepoint.errors import SaveError, weights_only_reason

_PLAIN = (int, float, str, bool, bytes, type(None))
_CONTAINERS = (dict, list, tuple)
_SAFE_CONTAINERS = (dict, list, tuple, OrderedDict)
# What a container may hold and be returned as it is, with no call per item: plain tensors and values, and
# the distributed tensors DCP writes as tensors of their own.
_LEAVES = frozenset({torch.Tensor, torch.nn.Parameter, DTensor, ShardedTensor, *_PLAIN})
_DICT_ONLY = frozenset({dict})


def restorable(value: Any, path: str = "", whole: bool = False) -> Any:
    """``value`` (a captured state dict) as restore will load it, or SaveError naming the first item it
    would refuse. Restore loads every non-tensor item with ``torch.load(weights_only=True)``; an item that
    fails that would make the checkpoint unrestorable, found only after the crash it was saved for.

    NumPy scalars are converted to the Python number of the same value (lossless: float64 and narrower
    floats, every integer width, bool; ``np.float64`` from ``lr=np.float64(1e-3)`` is common); containers
    holding one are copied, never changed in place (they may be the live optimizer's param groups). Any
    other item is checked by the real rule: a round trip through ``torch.load(weights_only=True)``.

    A tensor of a plain Python subclass of ``torch.Tensor`` is returned as a ``torch.Tensor`` over the same
    memory: a sync save would pickle its class with it, which restore's load refuses (an async save's
    staging copy was plain already); restore copies the values into the live subclass tensor. A wrapper
    subclass (its data in inner tensors) is kept, each one checked by the real rule.

    ``whole``: ``value`` lies inside a tuple, which DCP stores as one pickled value, container types and
    all (as it does a list of plain values): restore's load must refill each container there itself."""
    if type(value) in _LEAVES:
        return value
    if isinstance(value, torch.Tensor):
        return _tensor(value, path)
    if isinstance(value, _CONTAINERS):
        if _flat(value):
            return value  # a model's state dict, an optimizer's per-parameter state: nothing to check
        if type(value) not in _SAFE_CONTAINERS:  # OrderedDict (a model's state dict), a namedtuple, ...
            # The container type alone (with one plain item where it is pickled with its items), never
            # its tensors.
            items = whole or (isinstance(value, list) and _pickled_whole(value))
            _check_weights_only(_shell(value, items), path)
        if isinstance(value, dict) and _dicts_of_leaves(value):
            return value  # an optimizer's per-parameter state: thousands of flat dicts, checked in C
        # Tensors and plain values as they are, no call or path built for each (this runs every save).
        pre = f"{path}." if path or not isinstance(value, dict) else ""
        inner = whole or isinstance(value, tuple)
        pairs = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
        # A flat child (an optimizer's per-parameter state: thousands per save) is checked here, without a
        # call or a path of its own: a plain dict of plain leaves by one C-level check inline (a call of
        # ``_flat`` per child cost ~0.5 us each, 1.5 ms of a 3,000-parameter save), any other by ``_flat``.
        changed = {k: new for k, v in pairs if type(v) not in _LEAVES
                   and not (type(v) is dict and _LEAVES.issuperset(map(type, v.values())))
                   and not _flat(v) and (new := restorable(v, f"{pre}{k}", inner)) is not v}  # fmt: skip
        out = [changed.get(k, v) for k, v in pairs] if changed else None
        if out is None:
            return value
        kind: Any = type(value)  # rebuilt as it was: dict, OrderedDict, list, tuple, a namedtuple's class
        if isinstance(value, dict):
            return refilled(value, dict(zip(value, out, strict=True)))
        return kind._make(out) if _fields(kind) else kind(out)
    plain = _numpy_scalar(value)
    if plain is not None:
        return plain
    _check_weights_only(value, path)
    return value


def _tensor(value: torch.Tensor, path: str) -> torch.Tensor:
    """A tensor subclass as restore will load it (see ``restorable``)."""
    if not is_traceable_wrapper_subclass(value):
        return value.as_subclass(torch.Tensor)
    # Every one, at every save: what restore refuses depends on the instance (its flatten context and
    # attributes), not only on its type. The real rule (the whole tensor through torch.save and back, in
    # memory) runs once per pickled structure; later saves of the same structure only pickle it again.
    # The digest and the allowlist are taken once, before the rule runs: a verdict is recorded only under the
    # allowlist it was reached under (another thread may leave a ``safe_globals`` block meanwhile).
    key, allowlist = _digest(value), torch.serialization.get_safe_globals()
    if not _WRAPPERS.accepted(key, allowlist):
        _check_weights_only(value, path)
        _WRAPPERS.accept(key, allowlist)
    return value


def _flat(value: Any) -> bool:
    """A dict, list, tuple or OrderedDict of plain tensors and plain values only: restore loads it as it is.
    The types are compared in C (``issuperset`` over ``map``), with no Python call per item."""
    kind = type(value)
    if kind not in _SAFE_CONTAINERS:
        return False
    return _LEAVES.issuperset(map(type, value.values() if issubclass(kind, dict) else value))


def _dicts_of_leaves(value: dict[Any, Any]) -> bool:
    """Whether every value of ``value`` is a plain ``dict`` of plain tensors and plain values (each then
    returned as it is by ``restorable``): the types compared in C, with no Python call per child (~0.1 us
    a child against ~1 us through the comprehension of ``restorable``: 3,000 per save at 3,000 parameters)."""
    children = value.values()
    return _DICT_ONLY.issuperset(map(type, children)) and _LEAVES.issuperset(
        map(type, chain.from_iterable(map(dict.values, children)))
    )


def refilled(value: dict[Any, Any], items: dict[Any, Any]) -> dict[Any, Any]:
    """``items`` in a dict of ``value``'s type. Not ``type(value)(pairs)``: a ``Counter`` counts the pairs
    themselves, a ``defaultdict`` takes its first argument for its factory; a shallow copy of ``value``,
    emptied and refilled, keeps what its constructor needs (save/kinds.py's snapshot copies too)."""
    kind = type(value)
    if kind is dict or kind is OrderedDict:
        return kind(items)
    out = copy.copy(value)
    out.clear()
    out.update(items)
    return out


def _fields(kind: type) -> bool:
    return issubclass(kind, tuple) and hasattr(kind, "_fields") and hasattr(kind, "_make")  # a namedtuple


def _shell(value: Any, items: bool = False) -> Any:
    """An empty ``value`` of the same container type (a namedtuple: its fields None); with ``items`` (it is
    pickled with its items) a non-empty dict or list holds one plain item: restore's weights_only load
    refills only a dict, OrderedDict, Counter or list, whatever types are allowed, and an empty one has
    nothing to refill. Where the type cannot be built so, ``value`` itself (checked whole then)."""
    kind: Any = type(value)
    try:
        if _fields(kind):
            return kind._make([None] * len(value))
        shell = kind()
        if items and value and isinstance(shell, dict):
            shell.update({0: None})
        elif items and value and isinstance(shell, list):
            shell.append(None)
        return shell
    except Exception:
        return value


def _pickled_whole(value: list[Any]) -> bool:
    """DCP's rule (torch.distributed.checkpoint._traverse): a list with no tensor and no mapping in it, or in
    a list in it, is stored as one pickled value; any other list is walked item by item, its type not kept."""
    return not any(
        isinstance(x, (torch.Tensor, Mapping)) or (isinstance(x, list) and not _pickled_whole(x))
        for x in value
    )


def _numpy_scalar(value: Any) -> int | float | bool | None:
    """The Python number a NumPy scalar holds exactly, or None (not NumPy, or no exact Python twin)."""
    np = sys.modules.get("numpy")  # a NumPy scalar exists only if NumPy was imported
    if np is None or not isinstance(value, np.generic):
        return None
    if isinstance(value, (np.integer, np.bool_)) or (
        isinstance(value, np.floating) and value.dtype.itemsize <= 8
    ):
        item = value.item()
        return item if type(item) in (int, float, bool) else None
    return None


class _Structure(pickle.Pickler):
    """torch.save's pickle of a value without the bytes of its tensors: where torch.save names a record of a
    storage's bytes (its ``persistent_id``), this names only that one is there. Restore's weights_only load
    accepts or refuses a pickle by its opcodes and globals, never by a storage's bytes, so two values with
    the same structure pickle get the same verdict."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, (torch.storage.TypedStorage, torch.UntypedStorage)):
            return ("storage", type(obj).__name__)
        return None


class _WrapperVerdicts:
    """The pickled structures of wrapper tensors restore's load accepted (``_Structure``), so that a frozen
    NF4 base model is not serialised and loaded back in memory at every save (16 tensors of 16 MiB: 195-250
    ms of CPU per save, against 6-12 ms for their structures; benchmarks/bench_wrapper_check.py). Keyed by
    the structure's digest and by the
    allowlist it was judged under (``torch.serialization.add_safe_globals``: a change forgets every
    verdict); at most ``LIMIT`` kept (the least recently used dropped)."""

    LIMIT = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._accepted: OrderedDict[bytes, None] = OrderedDict()
        self._allowlist: list[Any] = []

    def accepted(self, key: bytes | None, allowlist: list[Any]) -> bool:
        with self._lock:
            if key is None or allowlist != self._allowlist or key not in self._accepted:
                return False
            self._accepted.move_to_end(key)
            return True

    def accept(self, key: bytes | None, allowlist: list[Any]) -> None:
        """Record ``key`` as accepted under ``allowlist``, the one the real rule judged it under; nothing if
        the allowlist has changed since (the verdict may not hold under the new one)."""
        if key is None or torch.serialization.get_safe_globals() != allowlist:
            return
        with self._lock:
            if allowlist != self._allowlist:
                self._accepted.clear()
                self._allowlist = allowlist
            self._accepted[key] = None
            if len(self._accepted) > self.LIMIT:
                self._accepted.popitem(last=False)


def _digest(value: Any) -> bytes | None:
    """The digest of ``value``'s pickled structure (``_Structure``, torch.save's protocol), or None where it
    cannot be pickled so (the real rule then says why)."""
    buf = io.BytesIO()
    try:
        _Structure(buf, protocol=torch.serialization.DEFAULT_PROTOCOL).dump(value)
    except Exception:
        return None
    return hashlib.blake2b(buf.getbuffer(), digest_size=32).digest()


_WRAPPERS = _WrapperVerdicts()


def _check_weights_only(value: Any, path: str) -> None:
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
        buf.seek(0)
        torch.load(buf, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, TypeError, AttributeError, ValueError) as e:
        why = weights_only_reason(e)
        raise SaveError(
            f"cannot save {path!r}: a {type(value).__name__} is not plain data, and restore (which loads "
            f"with torch.load(weights_only=True)) would refuse it ({why}). Store a tensor, a number, a "
            "string, or a list/dict of them instead (e.g. float(x), x.tolist(), torch.as_tensor(x))."
        ) from None
