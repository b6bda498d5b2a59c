"""DCP I/O for local and network file systems: checksummed writes and safe reads.

Write: DCP's own ``FileSystemWriter`` does the work (threads, one file per rank, fsync); we only swap its
file system for one whose write streams compute crc32c as bytes pass, so checksums cost no re-read.

Read: DCP loads ``.metadata`` with ``pickle.load`` and non-tensor items with
``torch.load(weights_only=False)``: a crafted checkpoint runs code. We read ``.metadata`` with an unpickler
that only resolves DCP's own metadata classes, and non-tensor items with ``weights_only=True``. Tensors are
read straight into their destinations where the saved record allows it (see ``SafeReader``).
"""

from __future__ import annotations

import io
import os
import pickle
import threading
import warnings
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, NoReturn

import crc32c
import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import (
    FileSystem,
    FileSystemReader,
    FileSystemWriter,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
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

from safepoint.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError, os_error_in_chain
from safepoint.store.checksum import ChecksummingWriter, ChecksumRecorder, ReadCoverage, fd_range_crc32c
from safepoint.store.direct_read import DescriptionCache, read_in_place
from safepoint.store.guard import open_regular, real_dir_problem

METADATA_NAME = ".metadata"

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


# torch.save's zip writer computes a CRC-32 of every record it writes. Inside safepoint's writer that is
# redundant: our crc32c covers every byte of every file and is verified before anything is loaded, and the
# CRC-32 cost more CPU than our crc32c (0.25 s per GiB here, about 8% of the save). torch's switch is
# process-wide (torch.serialization.set_crc32_options, read once per torch.save), so it is turned off while
# at least one safepoint write runs and put back when the last one ends. The trade-off: a torch.save that
# another thread of the same process runs meanwhile also writes its records with a zero CRC-32 field.
# torch.load does not check that field and reads such files normally; only zip tools (``unzip -t``) flag
# them. Set ``SKIP_TORCH_CRC32 = False`` to keep torch's CRC-32 at that cost.
SKIP_TORCH_CRC32 = True
_crc_lock = threading.Lock()
_crc_users = 0
_crc_saved = True


@contextmanager
def torch_crc32_off() -> Iterator[None]:
    """Turn torch.save's per-record CRC-32 off for the duration (nested and concurrent uses count)."""
    global _crc_users, _crc_saved
    if not SKIP_TORCH_CRC32:
        yield
        return
    with _crc_lock:
        if _crc_users == 0:
            _crc_saved = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _crc_users += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            # The last writer out restores the previous setting; if someone turned it back on meanwhile,
            # their choice stands.
            if _crc_users == 0 and not torch.serialization.get_crc32_options():
                torch.serialization.set_crc32_options(_crc_saved)


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
    with open(path, "rb") as f:
        return safe_load_metadata(f)


class _ChecksummingFileSystem(FileSystem):
    """DCP's local FileSystem, but every write stream records its size and crc32c."""

    def __init__(self, recorder: ChecksumRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        try:
            with open(path, mode) as raw:  # noqa: SIM117 - the wrapper takes ownership of raw
                with ChecksummingWriter(raw, Path(path).name, self.recorder) as stream:
                    yield stream  # type: ignore[misc]
        except Exception as e:
            self.recorder.failed(Path(path).name, e)
            raise

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        # The save's directory is created in ROOT/.pending: if that is a symlink, the save would be written
        # outside ROOT. Raised here, inside DCP's collective save, so every rank fails the save together.
        if problem := real_dir_problem(Path(path).parent):
            raise OSError(f"{Path(path).parent} is {problem}, not a directory; not saving through it")
        super().mkdir(path)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        self.recorder.rename(Path(path).name, Path(new_path).name)


class SafepointWriter(FileSystemWriter):
    """DCP FileSystemWriter that records (size, crc32c) of every file it writes, as it writes."""

    def __init__(self, path: str | os.PathLike[str], *, thread_count: int = 1) -> None:
        super().__init__(
            path, single_file_per_rank=True, sync_files=True, thread_count=thread_count, overwrite=True
        )
        self.recorder = ChecksumRecorder()
        self.fs = _ChecksummingFileSystem(self.recorder)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
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
        return fut

    def written_files(self) -> dict[str, tuple[int, str]]:
        return self.recorder.snapshot()


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
    ) -> None:
        super().__init__(path)
        self._checked_metadata = metadata
        self._expected = expected
        self._step = step

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not _is_local(self.fs):
            return super().read_data(plan, planner)
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        cache: DescriptionCache = {}
        for relative_path, reqs in per_file.items():
            self._read_file(relative_path, reqs, planner, cache)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_file(
        self, name: str, reqs: list[ReadItem], planner: LoadPlanner, cache: DescriptionCache
    ) -> None:
        fd = open_regular(self.fs.concat_path(self.path, name))
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
                item_crc = self._read_item(fd, req, planner, cache)
                if coverage is not None:
                    coverage.add(md.offset, md.length, item_crc)
            if coverage is not None and (actual := coverage.finish()) != crc:
                self._changed(name, f"crc32c {actual} != {crc}")
        finally:
            os.close(fd)

    def _changed(self, name: str, what: str) -> NoReturn:
        raise CorruptCheckpointError(
            self._step, name, f"{what} as read (the file changed after it was verified)"
        )

    def _read_item(self, fd: int, req: ReadItem, planner: LoadPlanner, cache: DescriptionCache) -> int:
        """Load one item; the crc32c of its bytes as read."""
        md: _StorageInfo = self.storage_data[req.storage_index]
        target = None
        if req.type != LoadItemType.BYTE_IO:
            target = planner.resolve_tensor(req).detach()
            if not md.transform_descriptors:
                crc = read_in_place(fd, md, req, target, cache)
                if crc is not None:
                    planner.commit_tensor(req, target)
                    return crc
        # DCP's own path (FileSystemReader.read_data) for this item, from the item's bytes read once here
        # (their crc32c is what is checked; the length was checked against the file's real size).
        raw = bytearray(md.length)
        got = os.preadv(fd, [raw], md.offset) if md.length else 0
        return self._load_item_bytes(req, md, raw, got, planner, target)

    def _load_item_bytes(
        self,
        req: ReadItem,
        md: _StorageInfo,
        raw: bytes | bytearray,
        got: int,
        planner: LoadPlanner,
        target: torch.Tensor | None,
    ) -> int:
        """Load one item from its bytes as read (``got`` of them); the crc32c of those bytes."""
        if got != md.length:
            raise CorruptCheckpointError(
                self._step, md.relative_path, f"item {req.storage_index.fqn!r} is cut short"
            )
        crc = crc32c.crc32c(raw)
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

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._checked_metadata is not None:
            metadata = self._checked_metadata
        else:
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = safe_load_metadata(f)  # type: ignore[arg-type]
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


def weights_only_load(stream: IO[bytes], fqn: str) -> Any:
    """``torch.load(weights_only=True)`` of one item; a refused pickle is an UnsafeCheckpointError."""
    try:
        return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message is a page long; its last line names the offending global.
        detail = str(e).strip().splitlines()
        why = next(
            (ln.strip() for ln in detail if "WeightsUnpickler error" in ln), detail[-1] if detail else ""
        )
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
    """Loads non-tensor items with ``torch.load(weights_only=True)`` instead of arbitrary unpickling."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = weights_only_load(value, fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _is_local(fs: object) -> bool:
    # DCP's local FileSystem (and our checksumming one); object stores bring their own file system.
    return isinstance(fs, FileSystem)
