"""DCP I/O straight to a store (an fsspec URL): checksummed streaming writes and safe reads.

The writer is DCP's own ``FileSystemWriter`` with its file system swapped, like ``storage.SafepointWriter``
for local roots: every write stream is a ``ChecksummingWriter`` (crc32c as bytes pass) over the store's
upload stream (``ObjectStore.open_writer``; on S3 parts go up while DCP is still writing and S3 checks each
part's CRC32C). A stream that fails is aborted, so no partial object is left to look complete.

The reader is ``reader.SafeReader`` (metadata unpickled with an allowlist) over the same file system;
load with ``reader.SafeLoadPlanner`` (non-tensor items with ``weights_only=True``).
"""

from __future__ import annotations

import io
import os
import pickle
import posixpath
import queue
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, cast

import crc32c
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, FileSystemWriter, SerializationFormat
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from safepoint.remote.incremental_copy import copier, proven_copy, read_previous_remote
from safepoint.remote.s3writer import open_writer
from safepoint.remote.upload import ObjectStore, UploadError
from safepoint.store.checksum import ChecksummingWriter, ChecksumRecorder, ReadCoverage
from safepoint.store.file_report import Files, skipped_per_rank, split_files, with_files
from safepoint.store.incremental import Record, Round
from safepoint.store.incremental_record import encode, side_name
from safepoint.store.item_writer import write_queue
from safepoint.store.reader import SafeReader

TORCH_SAVE = SerializationFormat.TORCH_SAVE
READ_PIECE = 8 * 1024 * 1024
"""The most read ahead of an object, and the piece a gap between loaded items is checksummed in."""


class _StoreFileSystem(FsspecFileSystem):
    """DCP's fsspec file system bound to one store; writes are checksummed, uploads verified."""

    def __init__(self, store: ObjectStore, recorder: ChecksumRecorder | None) -> None:
        super().__init__()
        self.fs = store.fs
        self.store = store
        self.recorder = recorder

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        path = os.fspath(path)
        if "w" not in mode:
            with self.store.fs.open(path, mode) as stream:
                yield stream
            return
        assert self.recorder is not None, "a reader never writes"
        raw = open_writer(self.store, path)
        stream = ChecksummingWriter(cast(IO[bytes], raw), posixpath.basename(path), self.recorder)
        try:
            yield cast(io.IOBase, stream)
        except BaseException as e:
            raw.abort()  # first: the stream's own cleanup closes raw, which must then create nothing
            stream.__exit__(type(e), e, e.__traceback__)
            raise
        stream.close()  # the upload completes (and is confirmed) here; only then is the file recorded

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        # DCP renames a rank's own __<r>.metadata.tmp where it saves without collectives (StoreWriter.finish
        # writes .metadata in place otherwise). A store copies server-side and deletes; nothing is
        # visible to readers before our manifest anyway. The copy is proven to hold what this writer
        # streamed (size, crc32c recorded), as any copy is: never taken by its size where the store keeps no
        # crc32c (Azure; S3 without CRC32C), so the file altered in place meanwhile is never committed.
        src, dst = os.fspath(path), os.fspath(new_path)
        known = None if self.recorder is None else self.recorder.snapshot().get(posixpath.basename(src))
        if known is None:
            self.store.copy(src, dst)
        elif problem := proven_copy(self.store, src, dst, *known):
            raise UploadError(f"copy of {self.store.url(src)} to {posixpath.basename(dst)}: {problem}")
        self.store.delete([src])
        if self.recorder is not None:
            self.recorder.rename(posixpath.basename(src), posixpath.basename(dst))

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        # Stores have no directories, and s3fs's makedirs would create a missing *bucket*: a typo in a
        # URL must fail, not make buckets. Local paths (file://) do need the directory.
        self.store.makedirs(os.fspath(path))

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return posixpath.join(os.fspath(path), suffix)


class StoreWriter(FileSystemWriter):
    """DCP writer into a store path; records (size, crc32c) of every file as it streams out, and hands
    each rank's list to the coordinator through DCP's write collective (store/file_report.py).

    Incremental saves (``incremental`` set by the saver): the unchanged stable groups of the previous
    committed step are copied server-side rather than sent (remote/incremental_copy.py); the rest is
    written as a local save writes it (store/item_writer.py: DCP's format, byte for byte)."""

    rank_files: list[Files] | None = None
    """Every rank's files, in rank order: set on the coordinator by :meth:`finish`."""
    rank_skipped: list[int] | None = None
    """Every rank's bytes copied server-side rather than sent, in rank order: set on the coordinator."""
    incremental: Round | None = None
    """Set by the saver: this save's incremental arrangement (store/incremental.py); None writes all."""
    _prefix = ""

    def __init__(self, store: ObjectStore, path: str, *, thread_count: int = 1) -> None:
        # sync_files: objects are durable once their upload completes; DCP's fallback os.sync() would only
        # flush unrelated local disks.
        super().__init__(path, single_file_per_rank=True, sync_files=False, thread_count=thread_count)
        self.recorder = ChecksumRecorder()
        self.fs = _StoreFileSystem(store, self.recorder)  # type: ignore[assignment]
        self.path = path
        self._store = store

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self._prefix = plan.storage_data.prefix  # "__<rank>_": the incremental layer names files with it
        fut = super().write_data(plan, planner)
        if len(results := fut.wait()) != len(plan.items):  # a writer thread failed (see storage.py)
            raise OSError(f"DCP writer threads wrote {len(results)} of {len(plan.items)} items")
        return with_files(fut, self.written_files(), self.linked_bytes())

    def linked_bytes(self) -> int:
        """Bytes of this rank's files copied server-side rather than sent (this save)."""
        return self.incremental.stats["linked"] if self.incremental is not None else 0

    def previous_record(self, layout: Any, rank: int) -> tuple[Record, int] | None:
        """``rank``'s verified record in the newest committed step of ``layout`` (a RemoteLayout)."""
        return read_previous_remote(layout, rank)

    def _write_data(self, planner: SavePlanner, file_queue: queue.Queue[Any]) -> Future[list[WriteResult]]:
        round_ = self.incremental
        if round_ is None or self.transforms.extensions or self.serialization_format != TORCH_SAVE:
            return super()._write_data(planner, file_queue)
        entries = []
        while not file_queue.empty():
            entries.append(file_queue.get_nowait())
        directory = Path(self.path)
        place = copier(self._store, str(self.path))
        out, placed = round_.arrange(directory, self._prefix, entries, planner, self.thread_count, place)
        if round_.record is not None:
            for name, stored in round_.record.files.items():
                self.recorder.record(name, stored.size, stored.crc32c)
        todo: queue.Queue[Any] = queue.Queue()
        for entry in out:
            todo.put(entry)
        results = write_queue(self, planner, todo)
        round_.written(directory, results, self.recorder.snapshot(), local=False)
        if round_.record is not None:
            # The fingerprints go with the step, listed in the manifest (store/incremental_record.py).
            name = side_name(int(self._prefix.strip("_")))
            with self.fs.create_stream(posixpath.join(self.path, name), "wb") as stream:
                stream.write(encode(round_, round_.history.since_full_after(round_)))
        results += placed
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results + round_.alias_results(results))
        return fut

    def _metadata_exists(self) -> bool:
        # DCP asks before it plans, only to warn that it overwrites (a HEAD and a listing on S3, three
        # requests on GCS). Nothing is overwritten that a reader trusts: a save writes in place only where
        # no manifest stands (RemoteLayout.new_pending; a committed step is re-saved under .pending/), and
        # a leftover of an interrupted save there is replaced whole by the PUT below.
        return False

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.rank_skipped = skipped_per_rank(results)
        self.rank_files, results = split_files(results)
        if not self.use_collectives:
            super().finish(metadata, results)
            return
        # DCP's finish, less its temporary object (as storage.SafepointWriter.finish on a disk): DCP writes
        # .metadata.tmp, asks whether .metadata exists, and renames, which a store does as a copy, a proof
        # of the copy and a delete (six to twelve requests). An object appears whole or not at all when its
        # upload completes, and no reader looks before the manifest is written, so .metadata is written
        # once, in place, checksummed as it streams and confirmed as every upload is. The fields set and the
        # pickle are DCP's own: the same bytes.
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        metadata.storage_meta = self.storage_meta()
        with self.fs.create_stream(self._get_metadata_path(), "wb") as stream:
            pickle.dump(metadata, stream)

    def written_files(self) -> dict[str, tuple[int, str]]:
        return self.recorder.snapshot()


class SafeStoreReader(SafeReader):
    """SafeReader (allowlisted metadata unpickling) reading from a store path.

    Given ``expected`` (the manifest's {file: (size, crc32c)}), every object is checked as it is read, like
    local files: each item's bytes are read once (a ranged read), loaded through DCP's path, and their
    crc32c combined with the gaps' into the object's, compared with the manifest at the end. An object
    replaced after verification raises CorruptCheckpointError (restore then falls back).
    """

    def __init__(self, store: ObjectStore, path: str, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _StoreFileSystem(store, None)  # type: ignore[assignment]
        self.path = path
        self._store = store

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._expected is None:
            return super().read_data(plan, planner)
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, reqs in per_file.items():
            self._read_object(name, reqs, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_object(self, name: str, reqs: list[ReadItem], planner: LoadPlanner) -> None:
        assert self._expected is not None
        size, crc = self._expected[name]
        # Read ahead one piece at most (s3fs's default is 50 MiB, on top of what is read); readahead named,
        # since gcsfs caches nothing by default: a request per item read (22 for a small model's file).
        path = posixpath.join(self.path, name)
        with self._store.open_read(path, block_size=READ_PIECE, cache_type="readahead") as f:
            if f.size != size:
                self._changed(name, f"size {f.size} != {size}")

            def read(offset: int, length: int) -> bytes:
                f.seek(offset)
                data: bytes = f.read(length) if length else b""
                return data

            def gap_crc(offset: int, length: int) -> int:
                # In pieces, like the local reader: a gap can be a whole ignored section (GBs).
                value, end = 0, offset + length
                for at in range(offset, end, READ_PIECE):
                    value = crc32c.crc32c(read(at, min(READ_PIECE, end - at)), value)
                return value

            coverage = ReadCoverage(gap_crc, size, name)
            for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                md = self.storage_data[req.storage_index]
                target = planner.resolve_tensor(req).detach() if req.type != LoadItemType.BYTE_IO else None
                raw = read(md.offset, md.length)
                item_crc = self._load_item_bytes(req, md, raw, len(raw), planner, target)
                coverage.add(md.offset, md.length, item_crc)
            if (actual := coverage.finish()) != crc:
                self._changed(name, f"crc32c {actual} != {crc}")
