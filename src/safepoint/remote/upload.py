"""upload: moving checkpoint files to and from a store, verified, in parallel, retried.

``ObjectStore`` works for any fsspec file system (gs://, az://, file://, memory://, ...): files are streamed
through ``fs.open`` with crc32c computed on the bytes actually sent, and confirmed afterwards by size and,
where the store reports one (GCS's ``crc32c``) or reading back is cheap (local files), by checksum.
A body damaged on the way is sent again (``DamagedInTransit``). ``remote.s3store.S3Store`` specialises it
for S3, where the store itself checks CRC32C, and ``remote.azstore.AzureStore`` for Azure (Content-MD5).
Every request is retried on transient errors (see retry.py).
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import crc32c

from safepoint.remote import rootstore
from safepoint.remote.confirmed import ConfirmedWrites
from safepoint.remote.rawwriter import FdWriter, FsWriter, RawWriter, StreamWriteError, stream_into, write_at
from safepoint.remote.retry import (
    DamagedInTransit,
    MiB,
    TransferOptions,
    UploadError,
    empty_if_unsatisfiable,
    lower_priority,
    retry,
)
from safepoint.store.checksum import crc32c_combine, crc_hex
from safepoint.store.guard import open_regular
from safepoint.store.manifest import Parts
from safepoint.store.rootfs import RootDir

__all__ = [
    "FileCopy",
    "MiB",
    "ObjectStore",
    "RawWriter",
    "StreamWriteError",
    "TransferOptions",
    "UploadError",
    "write_at",
]
log = logging.getLogger("safepoint")
T = TypeVar("T")
GATE_POLL_S = 0.1
"""How often a transfer parked at the shut gate checks whether it was abandoned."""


def b64_crc(crc: str) -> str:
    """A crc32c hex string as S3 and GCS spell it: base64 of the 4 big-endian bytes."""
    return base64.b64encode(int(crc, 16).to_bytes(4, "big")).decode()


def hex_crc(b64: str) -> str | None:
    """The inverse of b64_crc; None for anything that is not a plain 4-byte value (e.g. composite)."""
    try:
        raw = base64.b64decode(b64, validate=True)
    except (ValueError, TypeError):
        return None
    return raw.hex() if len(raw) == 4 else None


def open_local(path: str | os.PathLike[str], root: str | None) -> int:
    """A read-only descriptor of the local file ``path`` to upload: walked from ``root`` (the node's local
    root, which holds it) so no component below the root is followed as a symlink (store/rootfs.py), or,
    without one, opened by its path (the last component never a symlink, FIFO or device)."""
    return RootDir(root).open_read(Path(path)) if root is not None else open_regular(path)


def read_range(
    path: str | os.PathLike[str], offset: int, length: int, root: str | None = None
) -> tuple[bytes, int]:
    """``length`` bytes of a local file at ``offset`` and their crc32c. Raises EOFError if it ends early."""
    with os.fdopen(open_local(path, root), "rb", buffering=0) as f:
        data = os.pread(f.fileno(), length, offset)
    if len(data) != length:
        raise EOFError(f"{os.fspath(path)} ends before byte {offset + length} (changed while uploading?)")
    return data, crc32c.crc32c(data)


def combine(parts: Sequence[tuple[int, int]]) -> str:
    """crc32c hex of a file from its parts' (crc, length), in order."""
    value = 0
    for i, (crc, length) in enumerate(parts):
        value = crc if i == 0 else crc32c_combine(value, crc, length)
    return crc_hex(value)


def check_local(item: FileCopy, crc: str) -> None:
    """Refuse to upload a local file whose bytes (as read for the upload) no longer match its manifest."""
    if crc != item.crc32c:
        raise UploadError(
            f"upload of {item.local}: the local file no longer matches its manifest (crc32c {crc} != "
            f"{item.crc32c}); not uploading a damaged copy"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class FileCopy:
    """One file to move: local path, store path, and what the manifest says it holds."""

    local: str
    remote: str
    size: int
    crc32c: str
    root: str | None = None
    """The local root ``local`` lies under: the file is opened by walking from it (:func:`open_local`)."""


class ObjectStore:
    """Verified transfers over any fsspec file system (paths are the file system's own, no protocol)."""

    def __init__(self, fs: Any, cfg: TransferOptions | None = None) -> None:
        self.fs = fs
        self.cfg = cfg or TransferOptions()
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self.protocol: str = protocol
        # Reading back to confirm costs a second transfer over a network; on a local disk it is cheap.
        self.local = protocol in ("file", "local")
        self.guard: RootDir | None = None
        """A ``file://`` root's directory (set by ``open_store``): every write and delete under it walks it
        (store/rootfs.py), so a symlink planted below the root (``step-N``, ``.pending``, ``.run``) is
        never written or deleted through, as on the local tier; fsspec's local file system follows them."""
        # Cleared while the training loop waits for a save (tiering): transfers start no new request.
        self.gate = threading.Event()
        self.gate.set()
        # Set when the preemption grace ran out with the transfer still running: a thread parked at the
        # shut gate then raises instead of waiting forever (interpreter exit joins the pool's threads).
        self.abandoned = threading.Event()
        self.confirmed = ConfirmedWrites()  # what this process wrote and saw confirmed (confirmed.py)

    def pass_gate(self) -> None:
        """Wait while the gate is shut; raise :class:`UploadError` once the transfer is abandoned."""
        while not self.gate.wait(GATE_POLL_S):
            if self.abandoned.is_set():
                raise UploadError("the transfer was abandoned at the end of the preemption's grace")

    scheme: str | None = None
    """The scheme the user wrote (``az://`` rather than adlfs's ``abfs://``), shown in every URL; None:
    the file system's own. Set by ``open.open_store``."""

    def url(self, path: str) -> str:
        url = str(self.fs.unstrip_protocol(path))
        if self.scheme and "://" in url:
            return f"{self.scheme}://{url.split('://', 1)[1]}"
        return url

    def check_root(self, path: str) -> None:
        """Fail early and clearly if the root cannot be used (missing bucket, no access)."""
        if self.guard is not None:
            rootstore.make_root(self.guard)
        elif self.local:
            self.fs.makedirs(path, exist_ok=True)
        else:
            self.sizes(path)

    # ---- small objects ----------------------------------------------------------------------------------

    def put_bytes(self, path: str, data: bytes, *, if_absent: bool = False) -> None:
        """Write one small object (a manifest); ``if_absent``: fail with FileExistsError if it exists."""
        if if_absent:
            raise NotImplementedError(f"{self.protocol}:// has no conditional create")
        if self.guard is not None:  # a file:// root: its directories made as it goes (ROOT/.run/, step-N/)
            guard = self.guard
            retry(f"write of {self.url(path)}", lambda: rootstore.write_new(guard, path, data), self.cfg)
            return
        retry(f"write of {self.url(path)}", lambda: self.fs.pipe_file(path, data), self.cfg)

    def get_bytes(self, path: str, limit: int | None = None) -> bytes:
        """The object ``path``; with ``limit``, at most its first ``limit + 1`` bytes (one ranged read)."""
        what, guard = f"read of {self.url(path)}", self.guard
        if guard is not None:  # a file:// root: a regular file below it, never a symlink's
            return retry(what, lambda: rootstore.read_whole(guard, path, limit), self.cfg)
        if limit is None:
            return bytes(retry(what, lambda: self.fs.cat_file(path), self.cfg))
        return retry(what, lambda: empty_if_unsatisfiable(self.fs.cat_file, path, 0, limit + 1), self.cfg)

    def sizes(self, prefix: str) -> dict[str, int]:
        """{path relative to prefix: size} of every object under ``prefix`` (fresh listing, no cache)."""
        self.fs.invalidate_cache(prefix)
        try:
            found = retry(
                f"listing of {self.url(prefix)}", lambda: self.fs.find(prefix, detail=True), self.cfg
            )
        except UploadError as e:
            if isinstance(e.__cause__, FileNotFoundError):
                return {}
            raise
        base = prefix.rstrip("/") + "/"
        return {p[len(base) :]: int(d.get("size") or 0) for p, d in found.items() if p.startswith(base)}

    def delete(self, paths: Sequence[str]) -> None:
        """Delete ``paths``; one already missing counts as deleted (as on S3). fsspec's local, gs:// and
        az:// file systems raise FileNotFoundError for it instead, which used to stop cleanup right after
        the manifest and leak every data object of the step."""
        if paths:
            retry(f"delete of {len(paths)} objects", lambda: self._rm_present(list(paths)), self.cfg)

    def _rm_present(self, paths: list[str]) -> None:
        if self.guard is not None:  # unlinked through the walk: a link, never its target; missing is fine
            for path in paths:
                rootstore.remove(self.guard, path)
            return
        try:
            self.fs.rm(paths)
        except FileNotFoundError:
            for path in paths:  # one at a time: the bulk call may have stopped at the missing one
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm(path)

    # ---- files ------------------------------------------------------------------------------------------

    def put_files(self, items: Sequence[FileCopy]) -> dict[str, Parts]:
        """Upload files in parallel (bounded); each is confirmed. Raises the first failure (UploadError).
        Returns {store path: parts} for the objects whose stored checksum needs them (S3 composite)."""
        self._parallel(self.put_file, items)
        return {}

    def put_file(self, item: FileCopy) -> None:
        what = f"upload of {item.local} to {self.url(item.remote)}"

        # The whole file again if the stored object is not what was sent (DamagedInTransit from confirm).
        def once() -> None:
            self._stream_up(item)
            self.confirm(item)

        retry(what, once, self.cfg)

    def _stream_up(self, item: FileCopy) -> None:
        value, sent = 0, 0
        guard = self.guard
        with (
            os.fdopen(open_local(item.local, item.root), "rb") as src,
            os.fdopen(rootstore.create(guard, item.remote), "wb")
            if guard is not None
            else self.fs.open(item.remote, "wb") as dst,
        ):
            while chunk := src.read(self.cfg.part_size):
                self.pass_gate()
                value = crc32c.crc32c(chunk, value)
                dst.write(chunk)
                sent += len(chunk)
            if guard is not None:  # a file:// root's file is on its disk before the manifest names it
                dst.flush()
                os.fsync(dst.fileno())
            if (sent, crc_hex(value)) != (item.size, item.crc32c):
                # Raising inside the with-block leaves a partial object at most; no manifest points at it.
                raise UploadError(
                    f"upload of {item.local}: the local file no longer matches its manifest (size {sent}, "
                    f"crc32c {crc_hex(value)}; manifest: {item.size}, {item.crc32c}); not uploading it"
                )

    def confirm(self, item: FileCopy) -> None:
        """Check the stored object against the manifest entry: size, and the crc32c the store computed of
        what it received (GCS), or of the bytes read back where that is cheap (a local disk). Raises
        DamagedInTransit if the object is not what was sent (retried by sending the file again)."""
        try:
            size, crc = self.stored_checksum(item.remote)
        except FileNotFoundError:
            raise DamagedInTransit("the object is missing right after its upload") from None
        if size != item.size:
            raise DamagedInTransit(f"the store holds {size} bytes, {item.size} were sent")
        if crc is None and self.local:
            crc = self.read_crc(item.remote, size)
        if crc is not None and crc != item.crc32c:
            raise DamagedInTransit(f"the store computed crc32c {crc} of what arrived; sent: {item.crc32c}")

    def check(
        self,
        path: str,
        size: int,
        crc: str,
        *,
        read: bool = True,
        deep: bool = False,
        parts: Parts | None = None,
    ) -> str | None:
        """Why the object does not match (size, crc32c), or None.

        The crc32c is the store's own where it keeps one (or the one a composite checksum and the recorded
        ``parts`` vouch for); otherwise the bytes are read if ``read`` (or the store is a local disk, where
        reading is cheap). ``deep``: read even when the store has a checksum.
        """
        try:
            stored_size, stored_crc = self.stored_checksum(path, parts)
        except FileNotFoundError:
            return "file is missing"
        if stored_size != size:
            return f"size {stored_size} != {size} (truncated or extended)"
        if deep or (stored_crc is None and (read or self.local)):
            stored_crc = self.read_crc(path, size)
        if stored_crc is not None and stored_crc != crc:
            return f"crc32c {stored_crc} != {crc} (contents altered)"
        return None

    def prove(self, path: str, size: int, crc: str, parts: Parts | None = None) -> str | None:
        """:meth:`check` that never takes an object by its size: the store's own crc32c, else the bytes read
        back (what a server-side copy must pass; AzureStore also knows the versions it proved)."""
        return self.check(path, size, crc, read=True, parts=parts)

    def stored_checksum(self, path: str, parts: Parts | None = None) -> tuple[int, str | None]:
        """(size, crc32c the store computed) without reading the object; crc None if it has none. ``parts``:
        how the object went up, for a store whose checksum of a multipart object is a composite (S3)."""
        self.fs.invalidate_cache(path)
        guard, what = self.guard, f"stat of {self.url(path)}"
        try:
            if guard is not None:  # a file:// root's file: regular, reached without a symlink (rootstore)
                return retry(what, lambda: rootstore.size_of(guard, path), self.cfg), None
            info = retry(what, lambda: self.fs.info(path), self.cfg)
        except UploadError as e:
            if isinstance(e.__cause__, FileNotFoundError):
                raise e.__cause__ from None
            raise
        crc = info.get("crc32c")  # GCS reports base64 crc32c of every object
        return int(info.get("size") or 0), hex_crc(crc) if isinstance(crc, str) else None

    def read_crc(self, path: str, size: int) -> str:
        """crc32c of a stored object, read in ranges concurrently."""
        ranges = [(off, min(self.cfg.part_size, size - off)) for off in range(0, size, self.cfg.part_size)]

        def part(rng: tuple[int, int]) -> tuple[int, int]:
            off, n = rng
            guard, what = self.guard, f"read of {self.url(path)}"
            if guard is not None:
                data = retry(what, lambda: rootstore.read_range(guard, path, off, off + n), self.cfg)
            else:
                data = retry(what, lambda: self.fs.cat_file(path, start=off, end=off + n), self.cfg)
            return crc32c.crc32c(data), len(data)

        return combine(self._parallel(part, ranges)) if ranges else crc_hex(0)

    def open_read(self, path: str, *, block_size: int, cache_type: str = "readahead") -> Any:
        """``path`` open for reading (fsspec's file: ``size``, ``seek``, ``read``)."""
        if self.guard is not None:
            return rootstore.open_read(self.guard, path)
        return self.fs.open(path, "rb", block_size=block_size, cache_type=cache_type)

    def download(self, path: str, fd: int, size: int) -> str:
        """Copy an object into the new local file open as ``fd`` (fsync'd); return the crc32c of the bytes
        written. The caller made the file through the guarded walk (store/rootfs.py RootDir.create) and
        closes it: this never opens a local path, so a symlink planted there is never written through."""
        value, got = 0, 0

        def fetch() -> None:
            nonlocal value, got
            value, got = 0, 0
            os.ftruncate(fd, 0)  # a retry starts over
            if self.guard is not None:  # never through a symlink, never a FIFO; no more than size + 1 bytes
                value, got = rootstore.download(self.guard, path, fd, size, self.cfg.part_size)
                os.fsync(fd)
                return
            with self.fs.open(path, "rb") as src:
                value, got = stream_into(src, fd, self.cfg.part_size)
            os.fsync(fd)

        retry(f"download of {self.url(path)}", fetch, self.cfg)
        if got != size:
            raise UploadError(f"download of {self.url(path)}: got {got} bytes, expected {size}")
        return crc_hex(value)

    def abort_uploads(self, prefix: str) -> int:  # the multipart uploads aborted (S3; none elsewhere)
        return 0

    def copy(self, src: str, dst: str, size: int | None = None, crc: str | None = None) -> None:
        """Server-side copy where the store has one. ``size`` and ``crc``: what the manifest holds for
        ``src`` (a store that can check the copy against them itself does: S3's multipart copy); the
        caller still compares the copy with them afterwards (:meth:`check`): what each store proves of a
        copy is in docs/storage.md."""
        if self.guard is not None:  # as put_bytes: step-N/ may not exist yet when its first file is a copy
            guard = self.guard
            retry(f"copy of {self.url(src)}", lambda: rootstore.copy_within(guard, src, dst), self.cfg)
            return
        retry(f"copy of {self.url(src)}", lambda: self.fs.copy(src, dst), self.cfg)

    def open_writer(self, path: str) -> RawWriter:
        """A write stream that creates ``path`` on close (and nothing on abort)."""
        if self.guard is not None:
            guard = self.guard
            return FdWriter(rootstore.create(guard, path), lambda: rootstore.remove(guard, path))
        return FsWriter(self.fs, path)

    def sync_dirs(self, prefix: str) -> None:
        """A ``file://`` root: ``prefix`` and the directories up to the root fsync'd, so that the entries
        made in them (files, ``step-N/`` itself) outlive a power loss; a store has no directories."""
        if self.guard is not None:
            rootstore.sync_dirs(self.guard, prefix)

    def makedirs(self, path: str) -> None:
        """A directory of a ``file://`` root (made through the walk); stores have none (nothing done)."""
        if self.guard is not None:
            rootstore.makedirs(self.guard, path)

    # ---- helpers ----------------------------------------------------------------------------------------

    def _parallel(self, fn: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
        if len(items) <= 1:
            return [fn(i) for i in items]
        init = lower_priority if self.cfg.background else None
        with concurrent.futures.ThreadPoolExecutor(
            min(self.cfg.concurrency, len(items)), initializer=init
        ) as ex:
            futures = [ex.submit(fn, i) for i in items]
            concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
            failed = [f.exception() for f in futures if f.done() and not f.cancelled() and f.exception()]
            if failed:
                for f in futures:
                    f.cancel()  # start nothing more; the with-block waits for those running
                raise failed[0]  # type: ignore[misc]
            return [f.result() for f in futures]
