"""restore's read: DCP's file-system reader made safe (bare names, regular files, bytes checked against the
manifest as they are read, tensors read straight into their destinations where the record allows it).

Split from storage.py (the writer and ``.metadata``), which it builds on.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, NoReturn

import crc32c
import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import (
    FileSystem,
    FileSystemReader,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.futures import Future

from safepoint.data.own_keys import set_at
from safepoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    weights_only_reason,
)
from safepoint.store.checksum import ReadCoverage, fd_range_crc32c
from safepoint.store.direct_read import DescriptionCache, read_in_place
from safepoint.store.flatten_order import set_up_sharded_last
from safepoint.store.rootfs import RootDir, around
from safepoint.store.storage import safe_load_metadata
from safepoint.store.whole_plan import whole_item_plan


class SafeReader(FileSystemReader):
    """DCP FileSystemReader whose metadata is unpickled with an allowlist, reading tensors in place.

    DCP's reader ``torch.load``s every tensor item into freshly allocated memory and then ``copy_``s it into
    the destination: three copies of every byte and a fresh allocation (which faults in slowly on VMs). Each
    item is one ``torch.save`` zip inside the file. Where the item holds exactly the destination tensor
    (same dtype and shape, contiguous, no offset, host byte order: every single-process restore and every
    restore at the same sharding), its data record is read straight into the destination's memory
    (``direct_read``: only an offset and a description are taken from the zip, both checked). Anything else
    takes DCP's path.

    Given ``metadata`` (already checked: ``guard.load_checked_metadata``) it is used instead of reading
    ``.metadata`` again. Given ``expected`` ({file: (size, crc32c)} from the manifest), only regular files
    are opened (no symlink, no FIFO), and the crc32c of every byte read is checked against the manifest as
    it is read: a file replaced after verification raises CorruptCheckpointError.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        metadata: Metadata | None = None,
        expected: dict[str, tuple[int, str]] | None = None,
        step: int | None = None,
        root: RootDir | None = None,
    ) -> None:
        super().__init__(path)
        self.root = root
        """The checkpoint root ``path`` lies in: every file is opened walking from it (store/rootfs.py);
        a file elsewhere (another tier's, ``paths``) through a RootDir of its own directory."""
        self._checked_metadata = metadata
        self._expected = expected
        self._step = step
        self.prepare: Callable[[], Metadata] | None = None
        """Run by DCP's planning step on every rank, instead of reading ``.metadata``: what it raises
        reaches every rank through DCP's plan collective (restore/restorer.py verifies this way)."""
        self._deferred: Exception | None = None
        self.paths: Callable[[list[str]], dict[str, str]] | None = None
        """Given the files this rank reads, where each one is (per-node local tiers: this node's copy or a
        download, tiers/node_tiers.py); None: all under ``path``."""

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._deferred is not None:
            raise self._deferred
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not _is_local(self.fs):
            return super().read_data(plan, planner)
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        cache: DescriptionCache = {}
        where = self.paths(sorted(per_file)) if self.paths is not None else {}
        for relative_path, reqs in per_file.items():
            self._read_file(relative_path, reqs, planner, cache, where.get(relative_path))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_file(
        self,
        name: str,
        reqs: list[ReadItem],
        planner: LoadPlanner,
        cache: DescriptionCache,
        path: str | None = None,
    ) -> None:
        fd = self._open(Path(path) if path else Path(self.path) / name)
        try:
            coverage = None
            if self._expected is not None:
                size, crc = self._expected[name]
                if os.fstat(fd).st_size != size:
                    self._changed(name, f"size {os.fstat(fd).st_size} != {size}")
                coverage = ReadCoverage(lambda off, n: fd_range_crc32c(fd, off, n, name), size, name)
            # In file order: the reads then sweep the file once, front to back.
            for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                md: _StorageInfo = self.storage_data[req.storage_index]
                running = coverage.running(md.offset, md.length) if coverage is not None else None
                item_crc = self._read_item(fd, req, planner, cache, running or 0)
                if coverage is not None and running is not None:
                    coverage.extended(md.offset, md.length, item_crc)
            if coverage is not None and (actual := coverage.finish()) != crc:
                self._changed(name, f"crc32c {actual} != {crc}")
        finally:
            os.close(fd)

    def _changed(self, name: str, what: str) -> NoReturn:
        raise CorruptCheckpointError(
            self._step, name, f"{what} as read (the file changed after it was verified)"
        )

    def _read_item(
        self, fd: int, req: ReadItem, planner: LoadPlanner, cache: DescriptionCache, running: int
    ) -> int:
        """Load one item; ``running`` (the file's crc32c up to the item) extended by its bytes as read."""
        md: _StorageInfo = self.storage_data[req.storage_index]
        target = None
        if req.type != LoadItemType.BYTE_IO:
            target = planner.resolve_tensor(req).detach()
            if not md.transform_descriptors:
                crc = read_in_place(fd, md, req, target, cache, running)
                if crc is not None:
                    planner.commit_tensor(req, target)
                    return crc
        # DCP's own path (FileSystemReader.read_data) for this item, from the item's bytes read once here
        # (their crc32c is what is checked; the length was checked against the file's real size).
        raw = bytearray(md.length)
        got = os.preadv(fd, [raw], md.offset) if md.length else 0
        return self._load_item_bytes(req, md, raw, got, planner, target, running)

    def _load_item_bytes(
        self,
        req: ReadItem,
        md: _StorageInfo,
        raw: bytes | bytearray,
        got: int,
        planner: LoadPlanner,
        target: torch.Tensor | None,
        running: int = 0,
    ) -> int:
        """Load one item from its bytes as read (``got`` of them); the crc32c of those bytes, extending
        ``running`` (the local reader chains a file's crc through its items; a store reader starts at 0)."""
        if got != md.length:
            raise CorruptCheckpointError(
                self._step, md.relative_path, f"item {req.storage_index.fqn!r} is cut short"
            )
        crc = crc32c.crc32c(raw, running)
        stream: IO[bytes] = io.BytesIO(raw)
        if md.transform_descriptors:
            stream = self.transforms.transform_load_stream(req, md.transform_descriptors, stream)
        if target is None:
            planner.load_bytes(req, io.BytesIO(stream.read(-1)))
            return crc
        if not stream.seekable():
            stream = io.BytesIO(stream.read(-1))
        tensor = weights_only_load(stream, req.storage_index.fqn)
        if not isinstance(tensor, torch.Tensor):
            fqn = req.storage_index.fqn
            raise CheckpointError(f"item {fqn!r} holds a {type(tensor).__name__}, not a tensor")
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        if target.size() != tensor.size():
            raise CheckpointError(
                f"item {req.storage_index.fqn!r}: checkpoint holds shape {tuple(tensor.size())}, "
                f"the target is {tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(req, target)
        return crc

    def _open(self, path: Path) -> int:
        """A descriptor of the regular file ``path``: no symlink on the way from the root, no FIFO."""
        return around(path, self.root).open_read(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.prepare is not None:
            prepare, self.prepare = self.prepare, None
            try:
                self._checked_metadata = prepare()
            except Exception as e:
                # DCP turns a read_metadata failure into an AssertionError naming it; raised from
                # set_up_storage_reader instead, it reaches every rank as itself.
                self._deferred = e
                self._checked_metadata = Metadata(state_dict_metadata={})
        if self._checked_metadata is not None:
            metadata = self._checked_metadata
        else:
            with os.fdopen(self._open(Path(self._get_metadata_path(kwargs.get("rank")))), "rb") as f:
                metadata = safe_load_metadata(f)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _empty_bytes(*args: Any) -> bytes:
    """``bytes()`` for restore's load, and only that: pickle protocol 2 (torch.save's) writes ``b""`` as a
    call of the global ``bytes`` with no arguments, which ``weights_only`` refuses, so a state holding ``b""``
    was committed and could not be restored. ``bytes(n)`` allocates n bytes: a hostile record could ask
    for terabytes, so any argument is refused."""
    if args:
        raise pickle.UnpicklingError("global builtins.bytes is allowed with no arguments only")
    return b""


_LOAD_GLOBALS: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [(_empty_bytes, "builtins.bytes")]
_allowance_lock = threading.Lock()
_allowance_users = 0


@contextmanager
def _load_allowance() -> Iterator[None]:
    """``_LOAD_GLOBALS`` allowed while any restore's load runs. torch's allowlist is one set for the process
    and ``safe_globals`` takes its entries away on exit, for every thread: a load ending in one thread left
    another load mid-record without ``bytes()`` (its ``b""`` refused as unsafe). Counted, so the entries go
    when the last load ends; user code's loads meanwhile may build ``b""`` too, never ``bytes(n)``."""
    global _allowance_users
    with _allowance_lock:
        if _allowance_users == 0:
            torch.serialization.add_safe_globals(_LOAD_GLOBALS)
        _allowance_users += 1
    try:
        yield
    finally:
        with _allowance_lock:
            _allowance_users -= 1
            if _allowance_users == 0:
                # torch has no public remove; this exit removes exactly these entries, no one else's.
                torch.serialization.safe_globals(_LOAD_GLOBALS).__exit__(None, None, None)  # type: ignore[no-untyped-call]


def weights_only_load(stream: IO[bytes], fqn: str) -> Any:
    """``torch.load(weights_only=True)`` of one item; a refused pickle is an UnsafeCheckpointError."""
    try:
        with _load_allowance():
            return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message is a page long; weights_only_reason keeps the lines that say what was refused (a
        # blocked module's global, os.system say, has no "WeightsUnpickler error:" line at all).
        detail = str(e).strip().splitlines()
        why = weights_only_reason(e)
        if not any("global" in ln.lower() for ln in detail):
            # No refused global: these bytes are no pickle at all (an offset re-pointed inside a verified
            # file, say). Damage to fall back from, not a checkpoint that tried to run code.
            raise CorruptCheckpointError(
                None, None, f"item {fqn!r} is not a readable torch.save record ({why or 'unpickling failed'})"
            ) from None
        raise UnsafeCheckpointError(
            None, None, f"refusing to load item {fqn!r}: it is not plain data ({why})"
        ) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """Loads non-tensor items with ``torch.load(weights_only=True)`` instead of arbitrary unpickling, and
    plans a state whose tensors are all stored whole without DCP's resharding pass (``whole_plan``)."""

    whole_items = False
    """Whether the last local plan was written directly (``whole_item_plan``) rather than by DCP."""

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        # The state flattened first, its ShardedTensors then, as the save planner does (DCP's load planner
        # does the other, and lost an empty container in a list: store/flatten_order.py).
        set_up_sharded_last(self, lambda: super(SafeLoadPlanner, self).set_up_planner(
            state_dict, metadata, is_coordinator))  # fmt: skip

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is not None and self.flatten_state_dict:
            plan = whole_item_plan(self.state_dict, self.metadata)
            if plan is not None:
                self.whole_items = True
                return plan
        self.whole_items = False
        return super().create_local_plan()

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = weights_only_load(value, fqn)
        if self.flatten_state_dict:
            set_at(self.original_state_dict, self.mappings[fqn], obj)  # the state's own keys
        else:
            self.state_dict[fqn] = obj


def _is_local(fs: object) -> bool:
    # DCP's local FileSystem (and our checksumming one); object stores bring their own file system.
    return isinstance(fs, FileSystem)
