"""Incremental saves: write only the tensors that changed, and keep every ``step-N/`` complete.

A layer over the DCP writer (storage.py): before a rank's items are written, each tensor gets a content
fingerprint (xxh3-128 of its bytes, dtype, shape and strides, computed where the bytes are). Items are then
laid out in files by how they behave, so that unchanged bytes land apart from changing ones:

- *stable groups* (``__<rank>_<n>.distcp``, n >= 10**18): tensors whose fingerprint equalled the previous
  committed save's. A stable group whose every item is still unchanged is hard-linked from the previous
  step into the new one (same inode: no byte written), after the file was opened without following a link
  and found to be the very inode this process wrote (st_dev, st_ino, size). Where a link cannot be made
  (another file system, a link limit, the old step already deleted by retention) the group is written
  again from memory: the new step never depends on the old one still being there.
- the *changing* files (DCP's own ``__<rank>_<i>.distcp``): every tensor that changed or is new, and the
  non-tensor items.

Each step stays a plain DCP checkpoint: its ``.metadata`` maps each key to (file, offset, length) inside
the step's own directory, and its manifest lists every file with size and crc32c as before (a linked file
has the bytes, and so the checksum, it had), so verify, restore and ``cp -r step-N`` see no difference.

"Unchanged" is proven by the fingerprint, never assumed: ``requires_grad``, the optimizer and the autograd
version counter are not consulted, so a write through ``.data``, ``.numpy()``, DLPack, a collective or a
custom kernel (which the version counter misses) still changes the fingerprint and the tensor is written.

A tensor that is the very same view of the same memory as another item of the save (tied weights) is
written once; both keys map to the same bytes in ``.metadata``.

Bounded blast radius: a linked file is one inode shared by several steps. Every ``full_every`` saves nothing
is linked (a physical full copy), and retention keeps the newest step that shares no file with the newest
one (policy/retainer.py), so one damaged file always leaves an intact step (docs/reliability.md).
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _split_by_size_and_type, _StorageInfo
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from safepoint.store import byte_file
from safepoint.store.fingerprint import fingerprints, version_counter
from safepoint.store.item_writer import default_lookup, plain_tensor
from safepoint.store.links import Key as Key  # re-exported: the incremental layer's names
from safepoint.store.links import Linker
from safepoint.store.links import StoredFile as StoredFile
from safepoint.store.links import file_identity as _identity

Entry = tuple[str, str, list[WriteItem]]  # DCP's file queue entry: (path, file name, items)
Sizes = dict[str, tuple[int, str]]  # a writer's {file name: (size, crc32c)}
Place = Callable[[Path, "StoredFile"], "StoredFile | None"]  # puts a previous step's group into this one

# Stable groups are numbered <9-digit tag of this process><6-digit save><4-digit group>: DCP numbers a
# rank's own files 0..threads-1, every file name stays ``__<rank>_<n>.distcp`` (what tiers/transfer.py and
# the node map recognise as a rank's file), and the random tag keeps a name from meaning other bytes in
# another process's steps (an upload copies a stable group server-side by its name, size and crc32c).
STABLE_MIN = 10**18
# A stable group holds at most this many bytes: one tensor that starts changing again costs the rewrite of
# its group's other tensors, at most this much.
GROUP_BYTES = 128 * 1024 * 1024
DEFAULT_FULL_EVERY = 10
# manifest.extra[INCREMENTAL_KEY]: what rank 0's share of a save linked and wrote (for humans and benchmarks).
INCREMENTAL_KEY = "incremental"


_STABLE_NAME = re.compile(r"^__\d+_(\d{19,})\.distcp$")


def is_stable_group(name: str) -> bool:
    """Whether ``name`` is a stable group's file (a name no other bytes ever had, see STABLE_MIN)."""
    m = _STABLE_NAME.match(name)
    return m is not None and int(m.group(1)) >= STABLE_MIN


def item_key(item: WriteItem) -> Key:
    offset = item.index.offset
    return item.index.fqn, tuple(offset) if offset is not None else ()


def resolve_raw(planner: SavePlanner, item: WriteItem) -> torch.Tensor:
    """The planner's tensor for ``item``, where it lives (not copied to the host)."""
    raw = planner.resolve_data(item)
    if not isinstance(raw, torch.Tensor):
        raise TypeError(f"item {item.index.fqn!r}: expected a tensor, got {type(raw).__name__}")
    return raw


def _alias_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two items the very same values: same memory, dtype and view (tied weights), and the same
    conj and neg bits (``z.conj()`` and ``torch._neg_view(r)`` share everything else with ``z`` and ``r``)."""
    if type(t) is not torch.Tensor or t.layout != torch.strided or not t.numel():
        return None
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.is_conj(), t.is_neg())


@dataclasses.dataclass(slots=True)
class Record:
    """What one save of this rank left: every item's fingerprint and its stable groups."""

    fingerprints: dict[Key, bytes]
    files: dict[str, StoredFile]
    versions: dict[Key, tuple[int, int]]
    """(data_ptr, autograd version counter) of each tensor as the save saw it: a hint (see ``arrange``)."""
    directory: Path | None = None
    """The committed step directory the files lie in (set on commit)."""
    bytes_file: byte_file.ByteFile | None = None
    """The file of the save's non-tensor items, where the next save may link it (store/byte_file.py)."""

    def linked(self) -> list[StoredFile]:
        """The files in place before the save's writes: its stable groups, its non-tensor items' file."""
        return [*self.files.values(), *([self.bytes_file.stored] if self.bytes_file is not None else [])]


class History:
    """One rank's memory of its last committed save; owned by the saver, one save at a time."""

    def __init__(self, *, full_every: int = DEFAULT_FULL_EVERY) -> None:
        self.full_every = full_every
        self.last: Record | None = None
        self._since_full = 0
        self._seq = 0
        self.tag = secrets.randbelow(9 * 10**8) + 10**8
        self.stats: dict[str, int] = {}
        """Of the last save: bytes ``linked`` and ``written`` in stable groups, items ``aliased``."""
        self.encoded: dict[str, tuple[Any, bytes]] = {}
        """The last side file's parts, with what they encode (store/incremental_record.encode)."""

    @property
    def fresh(self) -> bool:
        """No save begun in this process yet."""
        return self._seq == 0

    def seed(self, previous: Record, since_full: int) -> None:
        """A new process's history: the record of the newest committed step (incremental_record.py), so
        its first save links what did not change. Only before this process's first save."""
        if self.last is None and self.fresh:
            self.last, self._since_full = previous, since_full

    def since_full_after(self, round_: Round) -> int:
        """Saves since the last physical full copy once ``round_``'s save is committed."""
        return 0 if round_.full else self._since_full + 1

    def begin(self, *, versions: bool = True) -> Round:
        """A new save's round. ``versions``: the tensors are the live ones (not staged copies, whose
        counters move at every copy), so a moved version counter may spare a changed tensor's fingerprint."""
        self._seq += 1
        full = self.last is None or (self.full_every > 0 and self._since_full + 1 >= self.full_every)
        return Round(self, self.last, self._seq, full=full, versions=versions)

    def committed(self, round_: Round, directory: Path) -> None:
        """``round_``'s save was committed into ``directory``: the next save compares against it."""
        if round_.record is None:
            self.last = None  # written without this layer (an extension writer): nothing to link from
            return
        round_.record.directory = directory
        self.last = round_.record
        self._since_full = self.since_full_after(round_)
        self.stats = dict(round_.stats)


class Round:
    """One save's arrangement: which items are linked, which written where."""

    def __init__(
        self, history: History, previous: Record | None, seq: int, *, full: bool, versions: bool
    ) -> None:
        self.history, self.previous, self.seq = history, previous, seq
        self.full, self.versions = full, versions
        """A physical full copy: unchanged tensors still go to stable groups, but nothing is linked."""
        self.record: Record | None = None
        self.known: dict[tuple[Any, ...], bytes | None] = {}
        """Fingerprints already proven for staged tensors, by ``_alias_key`` (save/staging.py computed them
        on the live tensors as it copied or skipped them): used instead of hashing the staged copy again.
        None: staging saw the live tensor's version counter move; it is written without a fingerprint."""
        self.stats = {"linked": 0, "written": 0, "aliased": 0}
        self._aliases: dict[Key, tuple[Key, WriteItem]] = {}
        self._stable: set[str] = set()
        self._bytes: tuple[str, byte_file.Pickles] | None = None  # the non-tensor items file, to record

    def arrange(
        self,
        directory: Path,
        prefix: str,
        entries: list[Entry],
        planner: SavePlanner,
        threads: int,
        place: Place | None = None,
    ) -> tuple[list[Entry], list[WriteResult]]:
        """The files to write (DCP's queue entries) and the results of the items already in place. Hashes
        each tensor item once. ``place(source_dir, stored)`` puts an unchanged stable group of the previous
        step here (default ``link_into``; a store copies it, remote/incremental_copy.py) or returns None."""
        items = [item for _, _, its in entries for item in its]
        fingerprints_: dict[Key, bytes] = {}
        versions: dict[Key, tuple[int, int]] = {}
        sizes: dict[Key, int] = {}
        primaries: dict[tuple[Any, ...], Key] = {}
        changing: list[WriteItem] = []
        unchanged: list[tuple[Key, WriteItem]] = []
        prev = self.previous
        still_before = {k for f in prev.files.values() for k in f.infos} if prev is not None else set()
        flat = default_lookup(planner)  # a plain tensor looked up by name, not by resolve_data's 4 calls
        # (key, item, tensor as written, its alias key): the alias key of the tensor as written is taken once
        # (seven attribute reads of torch per call; it was asked three times per item). Safe: a pure function
        # of the tensor's storage and view, which nothing changes between here and the loops below.
        tensors: list[tuple[Key, WriteItem, torch.Tensor, tuple[Any, ...] | None]] = []
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                changing.append(item)
                continue
            key = item_key(item)
            raw = plain_tensor(flat, item) if flat is not None else None
            if raw is None:
                raw = resolve_raw(planner, item)
            if (alias := _alias_key(raw)) is not None:
                if alias in primaries:
                    self._aliases[key] = (primaries[alias], item)
                    continue
                primaries[alias] = key
            sizes[key] = raw.numel() * raw.element_size()
            if alias is not None and alias in self.known and self.known[alias] is None:
                changing.append(item)  # staging saw it written to (the hint below, for staged copies)
                continue
            counter = version_counter(raw)  # None: an inference tensor, fingerprinted every save
            seen = prev.versions.get(key) if prev is not None and self.versions else None
            moved = False
            if counter is not None:
                version = versions[key] = (raw.data_ptr(), counter)
                moved = seen is not None and seen[0] == version[0] and seen[1] != version[1]
            if moved and key not in still_before:
                # The version counter moved: written (a hint only ever spares the fingerprint of a tensor
                # that is written anyway; "unchanged" always needs the fingerprint). Not for a tensor the
                # previous save found unchanged (in a stable group): one written once is fingerprinted, so
                # that the next save can prove it unchanged again and group it, rather than write it a
                # second time unhashed; one that changes at every save is not (it would only say "changed").
                changing.append(item)
                continue
            # A plain tensor needing no grad is hashed as it is: its detach() has the same storage, view and
            # dtype, so the same bytes and alias key. Anything else is detached, its alias key taken again.
            t = raw if alias is not None and not raw.requires_grad else raw.detach()
            if t.untyped_storage().nbytes() != t.nbytes:
                t = t.clone()  # as the writer saves it (a minimal storage); a GPU tensor's clone stays there
            tensors.append((key, item, t, alias if t is raw else _alias_key(t)))
        # Where each tensor lives: a GPU tensor is fingerprinted on the GPU (no copy to the host; only the
        # files left to write copy their tensors, in the writer).
        todo = [t for _, _, t, alias in tensors if alias not in self.known]
        computed = iter(fingerprints(todo))
        for key, item, _, alias in tensors:
            fp = (self.known.get(alias) if alias is not None else None) or next(computed)
            if fp is not None:
                fingerprints_[key] = fp
            if fp is not None and prev is not None and prev.fingerprints.get(key) == fp:
                unchanged.append((key, item))
            else:
                changing.append(item)
        self.record = Record(fingerprints_, {}, versions)
        results: list[WriteResult] = []
        placed: set[Key] = set()
        bytes_too = place is None and self.versions and flat is not None and bool(changing)
        if prev is not None and prev.directory is not None and not self.full:
            with Linker(prev.directory, directory) as linker:  # one descriptor of each directory
                if bytes_too:
                    assert flat is not None
                    changing, results = self._bytes_linked(linker, prefix, changing, flat)
                put = place or (lambda _, stored: linker.link(stored))
                results += self._place_groups(prev, put, unchanged, items, placed)
        elif bytes_too:
            assert flat is not None
            changing, results = self._bytes_linked(None, prefix, changing, flat)
        used = {Path(path).name for path, _, _ in entries} | set(self.record.files)
        out: list[Entry] = []
        for i, bucket in enumerate(_split_by_size_and_type(threads, changing) if changing else []):
            out.append((str(directory / f"{prefix}{i}.distcp"), f"{prefix}{i}.distcp", bucket))
        groups: list[tuple[list[WriteItem], int]] = []
        for key, item in unchanged:
            if key in placed:
                continue
            size = sizes[key]
            if not groups or groups[-1][1] + size > GROUP_BYTES:
                groups.append(([], 0))
            groups[-1][0].append(item)
            groups[-1] = (groups[-1][0], groups[-1][1] + size)
        n = 0
        for group, group_bytes in groups:
            while (name := f"{prefix}{self.history.tag}{self.seq % 10**6:06d}{n:04d}.distcp") in used:
                n += 1
            used.add(name)
            self._stable.add(name)
            out.append((str(directory / name), name, group))
            self.stats["written"] += group_bytes
        return out, results

    def _bytes_linked(
        self, linker: Linker | None, prefix: str, changing: list[WriteItem], flat: dict[str, Any]
    ) -> tuple[list[WriteItem], list[WriteResult]]:
        """A sync save whose changing items are all non-tensor ones: the previous step's file of them
        linked if it holds these very values (store/byte_file.py); else noted, to be recorded as written."""
        if any(item.type != WriteItemType.BYTE_IO for item in changing):
            return changing, []
        if (pickles := byte_file.pickles_of(flat, changing)) is None:
            return changing, []
        if linker is not None and self.previous is not None:
            linked = byte_file.link_previous(self.previous.bytes_file, linker, pickles)
            if linked is not None:
                assert self.record is not None
                self.record.bytes_file = linked
                self.stats["linked"] += linked.stored.size
                return [], byte_file.results_of(linked, changing, item_key)
        self._bytes = (f"{prefix}0.distcp", pickles)  # DCP's name of the one file all of them go to
        return changing, []

    def _place_groups(
        self,
        prev: Record,
        place: Place,
        unchanged: list[tuple[Key, WriteItem]],
        items: list[WriteItem],
        placed: set[Key],
    ) -> list[WriteResult]:
        """Put each stable group of ``prev`` whose every item is unchanged into the new step (``placed``
        gets their keys); the results of their items."""
        assert self.record is not None and prev.directory is not None
        results: list[WriteResult] = []
        keyed: dict[Key, tuple[int, WriteItem]] | None = None  # made once, when a first file is linked
        still = {key for key, _ in unchanged}
        for stored in prev.files.values():
            if not still.issuperset(stored.infos):
                continue
            linked = place(prev.directory, stored)
            if linked is not None:
                placed.update(stored.infos)
                self.record.files[stored.name] = linked
                self.stats["linked"] += stored.size
                if keyed is None:
                    keyed = {item_key(item): (n, item) for n, item in enumerate(items)}
                results += _results_of(stored, keyed)
        return results

    def written(
        self, directory: Path, results: list[WriteResult], files: Sizes, *, local: bool = True
    ) -> None:
        """Record the stable groups just written (``files``: the writer's {name: (size, crc32c)}; ``local``:
        in a local directory, whose inode is recorded; an object has none, its copy is checked instead)."""
        if self.record is None:
            return
        # The non-tensor items' file is recorded like a stable group, but apart (store/byte_file.py).
        items_file = self._bytes[0] if self._bytes is not None and local else None
        by_file: dict[str, dict[Key, tuple[int, int]]] = {}
        for r in results:
            info = r.storage_data
            if isinstance(info, _StorageInfo) and (
                info.relative_path in self._stable or info.relative_path == items_file
            ):
                key = (r.index.fqn, tuple(r.index.offset) if r.index.offset is not None else ())
                by_file.setdefault(info.relative_path, {})[key] = (info.offset, info.length)
        for name, infos in by_file.items():
            if name not in files:
                continue
            size, crc = files[name]
            stored: StoredFile | None = StoredFile(name, infos, size, crc, None)
            if local:
                st = os.stat(directory / name, follow_symlinks=False)
                stored = StoredFile(name, infos, size, crc, _identity(st)) if st.st_size == size else None
            if name == items_file:
                assert self._bytes is not None
                self.record.bytes_file = byte_file.recorded(stored, self._bytes[1])
            elif stored is not None:
                self.record.files[name] = stored

    def alias_results(self, results: list[WriteResult]) -> list[WriteResult]:
        """The results of the items that alias another item: the same bytes as their primary's."""
        if not self._aliases:
            return []
        where = {(r.index.fqn, tuple(r.index.offset or ())): r for r in results}
        out = []
        for primary, item in self._aliases.values():
            base = where.get(primary)
            if base is None:
                continue  # its write failed: the writer counts the missing results and raises
            out.append(
                WriteResult(
                    index=item.index, size_in_bytes=base.size_in_bytes, storage_data=base.storage_data
                )
            )
        self.stats["aliased"] = len(out)
        return out


def _results_of(stored: StoredFile, keyed: dict[Key, tuple[int, WriteItem]]) -> list[WriteResult]:
    """The write results of the items ``stored`` holds, in the save's item order. ``keyed`` (key ->
    (position, item)) is made once per save: a walk of every item for each linked file made a save of many
    files quadratic (19 linked groups x 200,000 items at 50,000 parameters: ~22 % of the save)."""
    out = []
    for key in sorted(stored.infos, key=lambda k: keyed[k][0]):
        offset, length = stored.infos[key]
        info = _StorageInfo(stored.name, offset, length)
        out.append(WriteResult(index=keyed[key][1].index, size_in_bytes=length, storage_data=info))
    return out
