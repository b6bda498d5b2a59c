"""DCP I/O for local and network file systems: checksummed writes and safe reads.

Write: DCP's own ``FileSystemWriter`` does the work (threads, one file per rank, fsync); we only swap its
file system for one whose write streams compute crc32c as bytes pass, so checksums cost no re-read.

Read: DCP loads ``.metadata`` with ``pickle.load`` and non-tensor items with
``torch.load(weights_only=False)``: a crafted checkpoint runs code. We read ``.metadata`` with an unpickler
that only resolves DCP's own metadata classes, and non-tensor items with ``weights_only=True``. Tensors are
read straight into their destinations where the saved record allows it (see ``SafeReader``).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import queue
import warnings
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    FileSystem,
    FileSystemWriter,
    SerializationFormat,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from safepoint.errors import CorruptCheckpointError, UnsafeCheckpointError, os_error_in_chain
from safepoint.store.checksum import ChecksummingWriter, ChecksumRecorder
from safepoint.store.crc_switch import torch_crc32_off
from safepoint.store.file_report import Files, skipped_per_rank, split_files, with_files
from safepoint.store.incremental import Round
from safepoint.store.incremental_record import encode, side_name
from safepoint.store.item_writer import write_queue
from safepoint.store.metadata_bytes import MetadataPickle
from safepoint.store.rootfs import RootDir

METADATA_NAME = ".metadata"
_PENDING = ".pending"  # posix_layout.PENDING_DIR (which imports this module)

# Single-process use is a supported mode, not an accident: DCP warns on every call without this.
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized")

# (module, name) pairs a genuine DCP .metadata pickle references. Everything else is refused.
_DCP_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP_MD, "Metadata"),
        (_DCP_MD, "MetadataIndex"),
        (_DCP_MD, "StorageMeta"),
        (_DCP_MD, "TensorProperties"),
        (_DCP_MD, "TensorStorageMetadata"),
        (_DCP_MD, "BytesStorageMetadata"),
        (_DCP_MD, "ChunkStorageMetadata"),
        (_DCP_MD, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }
)


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            None,
            METADATA_NAME,
            f"refusing to load: the metadata references {module}.{name}, which is not part of a DCP "
            "checkpoint (a crafted file could run code through it)",
        )


def safe_load_metadata(data: IO[bytes]) -> Metadata:
    """Unpickle DCP metadata, resolving only DCP's own classes."""
    try:
        md = _RestrictedUnpickler(data).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:
        # Damage, not a refusal: the checkpoint is corrupt (a restore falls back past it).
        raise CorruptCheckpointError(None, METADATA_NAME, f"unreadable DCP metadata ({e!r})") from None
    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(
            None, METADATA_NAME, f"metadata is a {type(md).__name__}, not DCP Metadata"
        )
    return md


def read_metadata_file(path: str | os.PathLike[str]) -> Metadata:
    """A ``.metadata`` file's DCP Metadata (tests and tools): a regular file, not read through a symlink."""
    with os.fdopen(RootDir(Path(path).parent).open_read(Path(path).name), "rb") as f:
        return safe_load_metadata(f)


def _no_pause() -> None:
    """The pause point of a save nothing runs beside (every sync save)."""


class _ChecksummingFileSystem(FileSystem):
    """DCP's local FileSystem, but every write stream records its size and crc32c, and every file DCP's
    writer touches (its data files, ``.metadata``, the save's directory, a rename of DCP's own finish)
    goes through the guarded walk (store/rootfs.py): DCP's FileSystemWriter does all its file access
    through these methods, so none of it is by path."""

    def __init__(self, recorder: ChecksumRecorder, root: RootDir) -> None:
        super().__init__()
        self.recorder, self.root = recorder, root
        # A background save's pause point before each file it creates: it waits there while the training
        # thread writes a save beside it (save/foreground.py). Holds no lock here.
        self.pause: Callable[[], None] = _no_pause

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        self.pause()
        path = Path(path)  # once (~5 us a Path: every file of every save comes here)
        if "w" not in mode:
            with os.fdopen(self.root.open_read(path), mode) as stream:
                yield stream  # type: ignore[misc]
            return
        try:
            # A new file (a link planted at the name is unlinked, never written through; O_EXCL|O_NOFOLLOW).
            with os.fdopen(self.root.create(path), mode) as raw:  # noqa: SIM117 - owned by the wrapper
                with ChecksummingWriter(raw, path.name, self.recorder) as stream:
                    yield stream  # type: ignore[misc]
        except Exception as e:
            self.recorder.failed(path.name, e)
            raise

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        self.make_save_dir(path)

    def make_save_dir(self, path: str | os.PathLike[str]) -> None:
        """DCP's ``mkdir`` of the save's directory, guarded (its name apart from Path.mkdir's)."""
        # The save's directory is created in ROOT/.pending: if that is a symlink, the save would be written
        # outside ROOT. Raised here, inside DCP's collective save, so every rank fails the save together.
        # First the one walk every save needs: it refuses a symlink or file anywhere on the way (ELOOP,
        # ENOTDIR) before making anything below it, so in a root as it should be (every steady save) the
        # look at .pending and the makedirs of the root's own path (two more walks, ~40 us) prove nothing
        # more; they run only when it failed, to say why (or to make a root removed meanwhile).
        try:
            self.root.makedirs(Path(path))
            return
        except OSError:
            pass
        parent = Path(path).parent
        if (problem := self.root.kind(parent)) not in (None, "a directory"):
            raise OSError(f"{parent} is {problem}, not a directory; not saving through it")
        self.root.make()  # the root's own path (and its parents) as given, as DCP's mkdir(parents=True) did
        self.root.makedirs(Path(path))  # walked from the root: a symlink on the way is ELOOP, not followed

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        # DCP's own finish renames .metadata.tmp -> .metadata (SafepointWriter.finish writes .metadata in
        # place): inside the save's directory only (OutsideRootError otherwise).
        self.root.move(Path(path), Path(new_path))
        self.recorder.rename(Path(path).name, Path(new_path).name)

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return self.root.lexists(Path(path))

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.root.remove(Path(path))

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        return [str(Path(path) / name) for name in self.root.listdir(Path(path))]


class SafepointWriter(FileSystemWriter):
    """DCP FileSystemWriter that records (size, crc32c) of every file it writes, as it writes, and hands
    each rank's list to the coordinator through DCP's write collective (store/file_report.py)."""

    rank_files: list[Files] | None = None
    """Every rank's files, in rank order: set on the coordinator by :meth:`finish`."""
    rank_skipped: list[int] | None = None
    """Every rank's bytes linked rather than written, in rank order: set on the coordinator by finish."""
    incremental: Round | None = None
    """Set by the saver: this save's incremental arrangement (store/incremental.py); None writes all."""
    metadata_pickle: MetadataPickle | None = None
    """Set by the saver: ``.metadata``'s pickle, its unchanged head kept (store/metadata_bytes.py)."""
    _prefix = ""

    def __init__(
        self, path: str | os.PathLike[str], *, thread_count: int = 1, root: RootDir | None = None
    ) -> None:
        """``root``: the checkpoint root the save's directory ``path`` lies in (every file is walked from
        it); by default ROOT for ROOT/.pending/<save>, else ``path``'s parent."""
        super().__init__(
            path, single_file_per_rank=True, sync_files=True, thread_count=thread_count, overwrite=True
        )
        self.recorder = ChecksumRecorder()
        where = Path(path).parent
        root = root or RootDir(where.parent if where.name == _PENDING else where)
        self.fs = self._fs = _ChecksummingFileSystem(self.recorder, root)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # DCP's, less its look for an existing .metadata (a guarded walk and an lstat per save): the
        # directory is a fresh pending one, named by this save's unique id, and with overwrite=True DCP
        # would only have warned.
        self._fs.make_save_dir(self.path)
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{self.rank}_"))
        return plan

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self._prefix = plan.storage_data.prefix  # "__<rank>_": the incremental layer names files with it
        # DCP's own writer threads (thread_count > 1) start and are joined inside this call: covered too.
        with torch_crc32_off():
            fut = super().write_data(plan, planner)
        results = fut.wait()
        # DCP's extra writer threads (thread_count > 1) swallow their exceptions (they only reach
        # threading.excepthook) and their items' results go missing: count them, never report success.
        if len(results) != len(plan.items):
            n, total = len(results), len(plan.items)
            what = f"DCP writer threads wrote {n} of {total} items; a writer thread failed"
            failure = self.recorder.first_failure()
            if failure is None:
                raise OSError(f"{what} (its error is in the log above)")
            name, error = failure
            cause = os_error_in_chain(error)
            raise OSError(f"{what} writing {name}: {type(cause).__name__}: {cause}") from error
        return with_files(fut, self.written_files(), self.linked_bytes())

    def pause_at(self, pause: Callable[[], None]) -> None:
        """Give this save's file creations a pause point (a background save's: save/foreground.py)."""
        self._fs.pause = pause

    def pause(self) -> None:
        """This save's pause point (a no-op unless ``pause_at`` gave one)."""
        self._fs.pause()

    def linked_bytes(self) -> int:
        """Bytes of this rank's files linked from the previous step rather than written (this save)."""
        return self.incremental.stats["linked"] if self.incremental is not None else 0

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.rank_skipped = skipped_per_rank(results)
        self.rank_files, results = split_files(results)
        # DCP's finish, less its temporary file: it writes .metadata.tmp, fsyncs it, removes an existing
        # .metadata and renames (three more guarded walks per save). Here the directory is always a fresh
        # pending one: no reader lists it until the commit renames it whole, after this file and the
        # directory are fsync'd (a crash before leaves a pending directory the next owner removes), and it
        # holds no older .metadata to replace (the create unlinks whatever stands there, O_EXCL). The fields
        # set and the pickle are DCP's own, so the bytes are the same; the write is checksummed as written.
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        metadata.storage_meta = self.storage_meta()
        per_rank = not self.use_collectives and self.rank is not None
        path = self._get_metadata_path(self.rank if per_rank else None)
        # pickle.dump's bytes; the saver's MetadataPickle pickles only what changed since its last save.
        cached = self.metadata_pickle
        data = pickle.dumps(metadata) if cached is None else cached.dumps(metadata)
        with self.fs.create_stream(path, "wb") as stream:
            stream.write(data)
            os.fsync(stream.fileno())

    def _write_data(self, planner: SavePlanner, file_queue: queue.Queue[Any]) -> Future[list[WriteResult]]:
        # DCP's own loop calls torch.save once per tensor item; item_writer writes the same bytes from a
        # per-shape template, in batched writes. Anything DCP's loop would treat differently (stream
        # extensions, safetensors) keeps DCP's loop.
        if self.transforms.extensions or self.serialization_format != SerializationFormat.TORCH_SAVE:
            return super()._write_data(planner, file_queue)
        fut: Future[list[WriteResult]] = Future()
        if self.incremental is None:
            fut.set_result(write_queue(self, planner, file_queue))
        else:
            fut.set_result(self._write_incremental(self.incremental, planner, file_queue))
        return fut

    def _write_incremental(
        self, round_: Round, planner: SavePlanner, file_queue: queue.Queue[Any]
    ) -> list[WriteResult]:
        """Link the unchanged stable groups from the previous step, write the rest (store/incremental.py)."""
        entries = []
        while not file_queue.empty():
            entries.append(file_queue.get_nowait())
        directory = Path(self.path)
        out, linked = round_.arrange(directory, self._prefix, entries, planner, self.thread_count)
        if round_.record is not None:
            for stored in round_.record.linked():
                self.recorder.record(stored.name, stored.size, stored.crc32c)
        results = self._write_entries(planner, out)
        round_.written(directory, results, self.recorder.snapshot())
        if round_.record is not None:
            # The fingerprints go with the step (listed in the manifest like every file): a new process
            # reads them back and its first save links too (store/incremental_record.py).
            since_full = round_.history.since_full_after(round_)
            name = side_name(int(self._prefix.strip("_")))
            with self.fs.create_stream(directory / name, "wb") as stream:
                stream.write(encode(round_, since_full))
                os.fsync(stream.fileno())
        results += linked
        return results + round_.alias_results(results)

    def _write_entries(self, planner: SavePlanner, entries: list[Any]) -> list[WriteResult]:
        """Write the arranged files (DCP queue entries: path, name, items) and record them; the writer
        process's proxy (save/process_writer.py) has its process write them instead."""
        if not entries:
            return []  # everything linked (a steady save): no queue, no writer threads to start and join
        todo: queue.Queue[Any] = queue.Queue()
        for entry in entries:
            todo.put(entry)
        return write_queue(self, planner, todo)

    def written_files(self) -> dict[str, tuple[int, str]]:
        return self.recorder.snapshot()
