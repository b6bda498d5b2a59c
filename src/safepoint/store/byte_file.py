"""The file of a save's non-tensor items, hard-linked from the previous step when they are what it holds.

DCP stores every non-tensor value of a state (an optimizer's lr, betas, weight decay, step counts: 13 for
an AdamW) as a ``torch.save`` of it in the rank's changing file (``__<rank>_0.distcp``). In a save where
no tensor changed, that file holds those items alone, and it is made anew every save: a create through
the guarded walk, the items' bytes, a crc32c, an fsync (~0.2 ms of a small state's ~6 ms save, issue 27).

Here, when a save's changing items are all non-tensor ones, each value is pickled (what the item writer's
``byte_item`` already compares at every save), and if the very same keys, in the very same order, pickle
to the very same bytes as the values in the previous save's file, that file is hard-linked into the new
step instead (store/links.py: only the inode written, proven by its identity after the link). Safe: equal
pickles unpickle to equal values, so the linked bytes are a ``torch.save`` of this save's very values
(the argument ``byte_item`` rests on), at the same offsets, so ``.metadata`` maps each key to the same
bytes, and the manifest lists the file with the size and crc32c it was written with. A value that does
not pickle, or pickles to more than the item writer remembers, is never linked. Only sync saves of a local
root do this (the live values; an object store copies stable groups by their unique names); a physical
full copy (incremental ``full_every``) writes it anew, so the file is shared under the same blast-radius
rule as a stable group (docs/reliability.md).
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from safepoint.store.item_writer import BYTE_CACHE_MAX
from safepoint.store.links import Linker, StoredFile

Pickles = tuple[tuple[str, bytes], ...]  # (fqn, the pickle of its value), in the file's order


@dataclasses.dataclass(frozen=True, slots=True)
class ByteFile:
    """A committed step's file of non-tensor items, and the pickles of the values it holds."""

    stored: StoredFile
    pickles: Pickles


def pickles_of(flat: dict[str, Any], items: list[WriteItem]) -> Pickles | None:
    """Each non-tensor item's value pickled, in order; None if one cannot be (then nothing is linked)."""
    out = []
    for item in items:
        fqn = item.index.fqn
        if fqn not in flat:
            return None
        try:
            data = pickle.dumps(flat[fqn], protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # not picklable alone: written by torch.save as ever, never linked
            return None
        if len(data) > BYTE_CACHE_MAX:
            return None
        out.append((fqn, data))
    return tuple(out)


def link_previous(previous: ByteFile | None, linker: Linker, now: Pickles) -> ByteFile | None:
    """``previous`` linked into the new step by ``linker`` if it holds ``now``."""
    if previous is None or previous.pickles != now:
        return None
    linked = linker.link(previous.stored)
    return ByteFile(linked, now) if linked is not None else None


def results_of(file: ByteFile, items: list[WriteItem], key: Any) -> list[WriteResult]:
    """The write results of ``items`` (the file's, in its order) as they lie in ``file``."""
    out = []
    for item in items:
        offset, length = file.stored.infos[key(item)]
        info = _StorageInfo(file.stored.name, offset, length)
        out.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
    return out


def recorded(stored: StoredFile | None, pickles: Pickles) -> ByteFile | None:
    """The file just written, as the save's results place its items (``stored``, with the identity it was
    written with), as the next save may link it; None if it holds anything but the items of ``pickles``."""
    if stored is None or stored.identity is None:
        return None
    if [fqn for fqn, _ in stored.infos] != [fqn for fqn, _ in pickles]:
        return None
    return ByteFile(stored, pickles)
