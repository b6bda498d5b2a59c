"""DCP I/O for local and network file systems: checksummed writes and safe reads.

Write: DCP's own ``FileSystemWriter`` does the work (threads, one file per rank, fsync); we only swap its
file system for one whose write streams compute crc32c as bytes pass, so checksums cost no re-read.

Read: DCP loads ``.metadata`` with ``pickle.load`` and non-tensor items with
``torch.load(weights_only=False)``: a crafted checkpoint runs code. We read ``.metadata`` with an unpickler
that only resolves DCP's own metadata classes, and non-tensor items with ``weights_only=True``.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from safepoint.checksum import ChecksummingWriter, ChecksumRecorder
from safepoint.errors import UnsafeCheckpointError

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
        raise UnsafeCheckpointError(None, METADATA_NAME, f"unreadable DCP metadata ({e!r})") from None
    if not isinstance(md, Metadata):
        raise UnsafeCheckpointError(
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
        with open(path, mode) as raw:  # noqa: SIM117 - the wrapper takes ownership of raw
            with ChecksummingWriter(raw, Path(path).name, self.recorder) as stream:
                yield stream  # type: ignore[misc]

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
        fut = super().write_data(plan, planner)
        results = fut.wait()
        # DCP's extra writer threads (thread_count > 1) swallow their exceptions (they only reach
        # threading.excepthook) and their items' results go missing: count them, never report success.
        if len(results) != len(plan.items):
            raise OSError(
                f"DCP writer threads wrote {len(results)} of {len(plan.items)} items; a writer thread failed "
                "(its error is in the log above)"
            )
        return fut

    def written_files(self) -> dict[str, tuple[int, str]]:
        return self.recorder.snapshot()


class SafeReader(FileSystemReader):
    """DCP FileSystemReader whose metadata is unpickled with an allowlist."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as f:
            metadata = safe_load_metadata(f)  # type: ignore[arg-type]
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Loads non-tensor items with ``torch.load(weights_only=True)`` instead of arbitrary unpickling."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            # torch's message is a page long; its last line names the offending global.
            detail = str(e).strip().splitlines()
            why = next(
                (ln.strip() for ln in detail if "WeightsUnpickler error" in ln), detail[-1] if detail else ""
            )
            raise UnsafeCheckpointError(
                None, None, f"refusing to load item {fqn!r}: it is not plain data ({why})"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
