"""``.metadata``'s bytes without pickling the unchanged part of DCP's Metadata anew at every save.

DCP's writer stores ``pickle.dump(metadata)``. With plan caching (save/plan_reuse.py), a save of an
unchanged structure gets DCP's cached Metadata: the very same object, holding the very same
``state_dict_metadata`` (every key's dtype, shape and chunks) and ``planner_data`` (every key's path).
Each save's ``finish`` only sets the last three fields: ``storage_data`` (where each item landed),
``storage_meta`` (this save's path and id) and ``version``. Yet the pickle of those first two was most of
``.metadata``'s cost in a small state's save (~0.15 of ~0.3 ms, issue 27).

The pickle of a Metadata is, inside one protocol-4 frame: the class, NEWOBJ, then its ``__dict__`` as
MARK, key, value, ... SETITEMS, then BUILD and STOP. So it splits where the ``storage_data`` entry starts:
a *head* that depends only on the object, its dict's keys and the first two values, and a *tail* of the
last entries. The head is made once per cached Metadata, by the pure-Python pickler stopped at that point,
which also gives its memo (which object was stored under which index); each save then pickles only the
tail, with C's pickler primed with that memo, so every object the tail shares with the head (a key's name,
a class) is referenced exactly as in a full pickle. Bytes are ``pickle.dumps(metadata)`` byte for byte:
checked when a head is made (the spliced bytes must equal ``pickle.dumps``; otherwise this Metadata is
never spliced), and the head is used only for that very object whose ``state_dict_metadata``,
``planner_data`` and dict keys are still the very objects it was made from (DCP builds a new Metadata
whenever the plan changes, and never edits a cached one: a changed structure is always pickled afresh).

A head is made at the second save that finishes the same Metadata object (a first save, or the writer
process's unpickled copy, new at every save, pays nothing), and only for a pickle of one frame (under
64 KiB: a large state's frames split where its size says, and its ``.metadata`` costs little beside its
items). One head per saver (``SyncSaver``): replaced when the structure changes, gone with the saver.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

_PROTOCOL = pickle.DEFAULT_PROTOCOL  # what pickle.dump(metadata, f) uses: DCP's writer passes none
_FRAME_MAX = 64 * 1024  # a pickle's frames are committed at this size: below it, one frame
_SPLIT = 2  # the head holds the dict's first two entries (state_dict_metadata, planner_data)
_MIN_FRAME = 4  # pickle writes a FRAME header only for frames at least this long


def _head_pickler(file: io.BytesIO, state: dict[str, Any]) -> Any:
    """The pure-Python pickler, noting in ``mark`` where the Metadata's ``_SPLIT``-th dict entry starts and
    the memo then. That dict is written as save_dict writes a dict of fewer than 1,000 entries (EMPTY_DICT,
    memoize, MARK, items, SETITEMS): the result is compared with C's pickle.dumps before it is used."""
    pickler: Any = getattr(pickle, "_Pickler")(file, protocol=_PROTOCOL)  # noqa: B009 - untyped in typeshed
    pickler.mark = None
    inner = pickler.save

    def save(obj: Any, save_persistent_id: bool = True) -> None:
        if obj is not state or pickler.mark is not None or id(obj) in pickler.memo:
            inner(obj, save_persistent_id)
            return
        pickler.framer.commit_frame()
        pickler.write(pickle.EMPTY_DICT)
        pickler.memoize(obj)
        pickler.write(pickle.MARK)
        for n, (key, value) in enumerate(obj.items()):
            if n == _SPLIT:
                frame = pickler.framer.current_frame
                pickler.mark = (frame.tell() if frame is not None else -1, dict(pickler.memo))
            save(key)
            save(value)
        pickler.write(pickle.SETITEMS)

    pickler.save = save  # the pickler calls self.save for every object: this one sees them all
    return pickler


class _Head:
    """The bytes of a Metadata's pickle up to its ``storage_data`` entry, and the memo there."""

    def __init__(self, md: Metadata, body: bytes, memo: dict[int, tuple[int, Any]]) -> None:
        self.md, self.body, self.memo = md, body, memo
        self.fields = (md.state_dict_metadata, md.planner_data)
        self.keys = tuple(md.__dict__)

    def fits(self, md: Metadata) -> bool:
        if md is not self.md or md.state_dict_metadata is not self.fields[0]:
            return False
        return md.planner_data is self.fields[1] and tuple(md.__dict__) == self.keys

    def spliced(self, md: Metadata) -> bytes | None:
        """``pickle.dumps(md)`` from this head and ``md``'s tail pickled now; None if it does not fit."""
        buf = io.BytesIO()
        pickler = pickle.Pickler(buf, protocol=_PROTOCOL)
        pickler.memo = self.memo  # copied in: the next index is the head's count, as in a full pickle
        pickler.dump(tuple(x for entry in list(md.__dict__.items())[_SPLIT:] for x in entry))
        out = buf.getvalue()
        start = 11 if out[2:3] == pickle.FRAME else 2  # PROTO, and FRAME with its 8-byte length
        end = pickle.TUPLE + pickle.MEMOIZE + pickle.STOP
        if out[:2] != pickle.PROTO + bytes([_PROTOCOL]) or out[start : start + 1] != pickle.MARK:
            return None
        if not out.endswith(end):
            return None
        frame = self.body + out[start + 1 : -len(end)] + pickle.SETITEMS + pickle.BUILD + pickle.STOP
        if not _MIN_FRAME <= len(frame) < _FRAME_MAX:
            return None
        return pickle.PROTO + bytes([_PROTOCOL]) + pickle.FRAME + len(frame).to_bytes(8, "little") + frame


class MetadataPickle:
    """``pickle.dumps`` of a save's Metadata, reusing the head of the previous save's (module docstring).
    One per saver; one save at a time."""

    def __init__(self) -> None:
        self._head: _Head | None = None
        self._last: Metadata | None = None  # the Metadata of the last save: a head is made at its second
        self._no_head: Metadata | None = None  # a Metadata found unfit for splicing: not tried again
        self.spliced = 0
        """Saves whose bytes came from a head (tests and benchmarks read it)."""

    def dumps(self, md: Metadata) -> bytes:
        head = self._head
        if head is not None and head.fits(md) and (data := head.spliced(md)) is not None:
            self.spliced += 1
            return data
        full = pickle.dumps(md, protocol=_PROTOCOL)
        again, self._last = md is self._last, md
        if again and md is not self._no_head and len(full) < _FRAME_MAX:
            self._head = _make_head(md, full)
            if self._head is None:
                self._no_head = md
        return full


def _make_head(md: Metadata, full: bytes) -> _Head | None:
    """A head for ``md`` whose splice gives ``full`` (its pickle) exactly, or None."""
    if len(md.__dict__) <= _SPLIT + 1 or full[2:3] != pickle.FRAME:
        return None  # a tail of one entry is pickled as SETITEM, not as a batch
    pickler = _head_pickler(io.BytesIO(), md.__dict__)
    try:
        pickler.dump(md)
    except Exception:  # the pure-Python pickler refuses what C's pickled: no head
        return None
    finally:
        del pickler.save  # the closure refers to the pickler: no cycle left for the collector
    if pickler.mark is None or pickler.mark[0] < 0:
        return None
    at, memo = pickler.mark
    # C's own memo after a full pickle must hold the head's objects under the same indices (then a tail
    # that meets one of them later is pickled as C's full pickle would). Where the two hold different
    # objects, both are temporaries made while pickling (a reduce's state tuple, a dtype's name), which no
    # later object can be: equal values of one type are required there.
    c_pickler = pickle.Pickler(io.BytesIO(), protocol=_PROTOCOL)
    c_pickler.dump(md)
    c_objs = {index: obj for index, obj in c_pickler.memo.copy().values()}
    for index, obj in memo.values():
        other = c_objs.get(index)
        if other is not obj and (type(other) is not type(obj) or other != obj):
            return None
    head = _Head(md, full[11 : 11 + at], memo)
    return head if head.spliced(md) == full else None
