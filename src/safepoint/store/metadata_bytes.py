"""``.metadata``'s bytes without pickling its unchanged part again at every save (issue 27).

DCP's ``.metadata`` is ``pickle.dump(metadata)`` of a ``Metadata`` whose fields pickle in this order:
``state_dict_metadata``, ``planner_data``, ``storage_data`` (the *head*: every key's dtype, shape and chunks,
its path in the state dict, and where its bytes lie) and ``storage_meta``, ``version`` (the *tail*: this
save's own directory and id). In a run of saves of one state the head is the same at every save, and
pickling it is most of ``.metadata``'s cost: ~100 small dataclass objects at ~5 us each, ~0.5 ms of a small
state's ~9 ms save. Here the head is pickled once; a later save whose head is *proven equal* writes the
remembered head's bytes and pickles only its tail, with a pickler that continues from the head's memo, so
the result is the pickle ``pickle.dumps(metadata)`` would write.

The proof, at every save, of "this head pickles as the remembered one":

- ``storage_data`` (made afresh by each save's writer): the ``__dict__`` of each key and value, in order,
  equal to the remembered ones, every field of a type listed for it (``_where``); keys and values of exact
  classes. ``MetadataIndex.index``, which its ``__eq__`` ignores, is in its ``__dict__``.
- ``state_dict_metadata`` and ``planner_data`` (the planner's, the same objects at every save while DCP
  reuses its cached global plan): the very objects pickled when the head was remembered (held here, so
  their ids are never reused), still equal by ``==`` to a copy taken then, with the same orders (every
  dict and pickled ``__dict__``) and every object and field of a class or type listed for it (``_shape``),
  which closes what ``==`` alone lets through: ``True == 1``, ``torch.Size((1,)) == (1,)``, an attribute
  the dataclass's ``__eq__`` does not compare.

Anything else (a subclass, an unknown value, an extension's transform descriptors) is pickled whole, as
DCP does. The checks are set and tuple work at C speed but one list per tensor entry: about half of what
pickling the head costs.

The splice is checked when it is made: the head is pickled from an unpickled copy (which holds nothing
of the caller's), the save's own tail is continued from that head's memo, and the result must equal
``pickle.dumps`` of the whole ``Metadata``, byte for byte, or nothing is remembered. A later save's tail
differs only in the values of ``storage_meta`` (the pending path, the save id): the same classes, pickled
by the same pickler from the same memo (its back-references to the head are to strings and classes that
the remembered head holds; a string of the tail equal to one of the head but not the same object would be
written again rather than referenced: the same value either way). Only a pickle of one frame (under 64 KiB: a small state, where the
fixed cost matters) is spliced; a bigger one, and any protocol other than 4 and 5, is pickled whole.
"""

from __future__ import annotations

import io
import pickle
from itertools import chain
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

_HEAD = ("state_dict_metadata", "planner_data", "storage_data")
_FIELDS = (*_HEAD, "storage_meta", "version")
_FRAME = b"\x95"  # pickle's FRAME opcode (protocol 4+): 8 bytes of length follow
# The C pickler starts a new frame once one holds 64 KiB: below that a pickle is one frame, and the splice
# (one frame, its length recomputed) is what it writes. A margin for the tail's growth (a longer path).
_ONE_FRAME = 64 * 1024 - 4096
_Size = torch.Size
# What each kind of object in a head may hold, by exact type (``type(x)``: ``True`` is not an int here, a
# tuple is not a ``torch.Size``, a ``str`` subclass is not a str). With these, ``==`` (value equality, the
# dataclasses' ``__eq__`` checking the class too) and the same orders are pickle equality.
_KEYS = frozenset({str})
_ENTRIES = frozenset({TensorStorageMetadata, BytesStorageMetadata})
_ENTRY_FIELDS = frozenset({TensorProperties, _Size, list})
_PROPERTY_FIELDS = frozenset({torch.dtype, torch.layout, torch.memory_format, bool})
_CHUNKS = frozenset({ChunkStorageMetadata})
_CHUNK_FIELDS = frozenset({_Size})
_PATHS = frozenset({tuple})
_PATH_PARTS = frozenset({str, int})
_INDEXES = frozenset({MetadataIndex})
_INDEX_FIELDS = frozenset({str, _Size, int, type(None)})
_INFOS = frozenset({_StorageInfo})
_INFO_FIELDS = frozenset({str, int, type(None)})
_values = dict.values


def _names(dicts: list[dict[str, Any]]) -> tuple[tuple[str, ...], ...]:
    """Each object's attribute names, in order (a pickled ``__dict__`` keeps its order)."""
    return tuple(map(tuple, dicts))


def _typed(dicts: list[dict[str, Any]], allowed: frozenset[type]) -> bool:
    return set(map(type, chain.from_iterable(map(_values, dicts)))) <= allowed


def _shape(metadata: Metadata) -> tuple[Any, ...] | None:
    """The planner's part of the head (``state_dict_metadata``, ``planner_data``) as what ``==`` does not
    see: the order of every dict and ``__dict__`` that is pickled as such; None unless every object is of
    a class listed above and each field of a type listed for it."""
    sdm, paths = metadata.state_dict_metadata, metadata.planner_data
    if type(sdm) is not dict or type(paths) is not dict:
        return None
    entries = [v for v in sdm.values() if type(v) is TensorStorageMetadata]
    others = [v for v in sdm.values() if type(v) is not TensorStorageMetadata]
    try:
        props = [v.properties for v in entries]
        chunks = list(chain.from_iterable(v.chunks for v in entries))
        flags = [(p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory) for p in props]
    except (AttributeError, TypeError):
        return None
    fields, chunk_fields = list(map(vars, entries)), list(map(vars, chunks))
    if not (
        set(map(type, sdm)) <= _KEYS
        and set(map(type, others)) <= {BytesStorageMetadata}
        and not any(map(vars, others))
        and _typed(fields, _ENTRY_FIELDS)
        and set(map(type, props)) <= {TensorProperties}
        and set(map(type, chain.from_iterable(flags))) <= _PROPERTY_FIELDS
        and set(map(type, chunks)) <= _CHUNKS
        and _typed(chunk_fields, _CHUNK_FIELDS)
        and set(map(type, paths)) <= _KEYS
        and set(map(type, paths.values())) <= _PATHS
        and set(map(type, chain.from_iterable(paths.values()))) <= _PATH_PARTS
    ):
        return None
    return tuple(sdm), tuple(paths), _names(fields), _names(chunk_fields), tuple(flags)


def _where(metadata: Metadata) -> tuple[Any, ...] | None:
    """``storage_data`` (made afresh by every save's writer) as names and values, or None if its objects
    or their fields are not of the types listed above."""
    where = metadata.storage_data
    if type(where) is not dict or not set(map(type, where)) <= _INDEXES:
        return None
    if not set(map(type, where.values())) <= _INFOS:
        return None
    keys, infos = list(map(vars, where)), list(map(vars, where.values()))
    if not (_typed(keys, _INDEX_FIELDS) and _typed(infos, _INFO_FIELDS)):
        return None
    return _names(keys), tuple(keys), _names(infos), tuple(infos)


def _body(pickled: bytes, proto: bytes) -> bytes | None:
    """The opcodes of a one-frame pickle (between PROTO+FRAME and STOP), or None."""
    if not pickled.startswith(proto) or not pickled.endswith(b"."):
        return None
    if len(pickled) > len(proto) and pickled[len(proto)] == _FRAME[0]:
        start = len(proto) + 9
        if int.from_bytes(pickled[len(proto) + 1 : start], "little") != len(pickled) - start:
            return None  # more than one frame
        return pickled[start:-1]
    return pickled[len(proto) : -1]


class MetadataPickle:
    """One saver's remembered ``.metadata`` head (see the module docstring). One save at a time."""

    def __init__(self) -> None:
        self._plan: tuple[Any, Any] = (None, None)  # the planner's objects pickled: held, so never reused ids
        self._copy: tuple[Any, Any] = (None, None)  # their values then (an unpickled copy)
        self._shape: tuple[Any, ...] | None = None  # their orders and flags then (``_shape``)
        self._where: tuple[Any, ...] | None = None
        self._head = b""  # the head's opcodes: up to the tail's first key, inside the head's MARK
        self._memo: Any = None  # the head pickler's memo (what the tail's back-references index)
        self.reused = 0  # saves whose head was not pickled again (tests, benchmarks)

    def dumps(self, metadata: Metadata) -> bytes:
        """``pickle.dumps(metadata)``: its head remembered from the previous save where provably equal."""
        proto = pickle.DEFAULT_PROTOCOL
        if proto not in (4, 5) or type(metadata) is not Metadata or tuple(vars(metadata)) != _FIELDS:
            return pickle.dumps(metadata)
        where = _where(metadata)
        if where is not None and self._same(metadata, where):
            spliced = self._splice(metadata, proto)
            if spliced is not None:
                self.reused += 1
                return spliced
        whole = pickle.dumps(metadata)
        self._remember(metadata, where, whole, proto)
        return whole

    def _same(self, metadata: Metadata, where: tuple[Any, ...]) -> bool:
        sdm, paths = metadata.state_dict_metadata, metadata.planner_data
        return (
            sdm is self._plan[0]
            and paths is self._plan[1]
            and where == self._where
            and sdm == self._copy[0]
            and paths == self._copy[1]
            and _shape(metadata) == self._shape
        )

    def _splice(self, metadata: Metadata, proto: int) -> bytes | None:
        out = io.BytesIO()
        p = pickle.Pickler(out, proto)
        p.memo = self._memo  # a copy of the head's memo: this pickler's back-references are the head's
        header = bytes((pickle.PROTO[0], proto))
        tail = [self._head]
        state = vars(metadata)
        for name in _FIELDS[3:]:
            for obj in (name, state[name]):
                out.seek(0)
                out.truncate()
                p.dump(obj)
                part = _body(out.getvalue(), header)
                if part is None:
                    return None
                tail.append(part)
        body = b"".join(tail) + pickle.SETITEMS + pickle.BUILD + pickle.STOP
        if len(body) > _ONE_FRAME:
            return None
        return header + bytes((_FRAME[0],)) + len(body).to_bytes(8, "little") + body

    def _remember(self, metadata: Metadata, where: tuple[Any, ...] | None, whole: bytes, proto: int) -> None:
        self._plan, self._copy, self._shape, self._where = (None, None), (None, None), None, None
        self._head, self._memo = b"", None
        shape = _shape(metadata)
        if where is None or shape is None or len(whole) > _ONE_FRAME:
            return
        # The head pickled from a copy of this save's Metadata (its own objects: nothing the caller holds
        # can change it later), alone: a Metadata of the head's three fields only.
        copy = pickle.loads(whole)  # noqa: S301 - pickled just above, from DCP's Metadata (types checked)
        head = Metadata.__new__(Metadata)
        vars(head).update({name: vars(copy)[name] for name in _HEAD})
        out = io.BytesIO()
        p = pickle.Pickler(out, proto)
        p.dump(head)
        body = _body(out.getvalue(), bytes((pickle.PROTO[0], proto)))
        closing = pickle.SETITEMS + pickle.BUILD
        if body is None or not body.endswith(closing):
            return
        self._head, self._memo = body[: -len(closing)], p.memo
        if self._splice(metadata, proto) != whole:  # checked when made: else never spliced
            self._head, self._memo = b"", None
            return
        self._plan = (metadata.state_dict_metadata, metadata.planner_data)
        self._copy = (copy.state_dict_metadata, copy.planner_data)
        self._shape, self._where = shape, where
