"""commit: the on-disk layout and the commit protocol for local and network file systems.

    ROOT/step-<N>/           committed: a plain DCP directory plus safepoint.json (written last)
    ROOT/.pending/<name>/    saves in progress, and checkpoints on their way out; never listed or loaded
    ROOT/.lease              who owns ROOT (see lease.py)

Commit = fsync data files (DCP does), write + fsync the manifest, fsync the directory, rename it into
place, fsync ROOT. Removal = one rename into .pending (atomic: the step is listed or it is not), then
delete. Replacing an existing step swaps the two directories atomically (renameat2 RENAME_EXCHANGE) so the
committed copy is never gone before the new one is in place.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import os
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

from torch.distributed.checkpoint.metadata import Metadata

from safepoint.errors import CheckpointError, CorruptCheckpointError
from safepoint.store import root_ops
from safepoint.store.checksum import crc32c_combine, crc_hex, crc_ranges
from safepoint.store.file_lease import Lease
from safepoint.store.fsops import fsync_dir  # tests/torture patches it here
from safepoint.store.guard import (
    MISSING,
    STEP_PREFIX,
    describe_mode,
    parked_step_name,
    parse_step,
    read_up_to,
)
from safepoint.store.heartbeat import HeartbeatLease
from safepoint.store.held_dirs import holding
from safepoint.store.manifest import MANIFEST_NAME, Manifest
from safepoint.store.metadata_check import load_checked_metadata
from safepoint.store.protocol import CheckpointInfo as CheckpointInfo  # re-exported: its old home
from safepoint.store.protocol import CheckpointStore as CheckpointStore
from safepoint.store.reader import SafeReader
from safepoint.store.root_ops import identity as _identity  # the seams tests patch here (root_ops' docstring)
from safepoint.store.root_ops import remove_manifest_first as _remove_manifest_first
from safepoint.store.root_ops import remove_tree, write_file_durably
from safepoint.store.root_ops import rename_exchange as _rename_exchange
from safepoint.store.rootfs import RootDir, around
from safepoint.store.storage import METADATA_NAME, SafepointWriter

log = logging.getLogger("safepoint")
PENDING_DIR = ".pending"
_REPLACED_PREFIX = "replaced-"
_DELETING_PREFIX = "deleting-"
# A manifest lists each file in ~100 bytes: 64 MiB is far beyond any real one (and bounds what is read).
MAX_MANIFEST_BYTES = 64 << 20
# Concurrent readers when verifying: big files split into ranges so the disk sees several requests at once
_VERIFY_THREADS = 8  # (cold-cache reads measured ~2x faster than one sequential reader; crc32c frees the GIL)


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step}"


class Layout:
    """Local/NFS checkpoint root. All paths and the commit protocol live here and nowhere else."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.pending_root = self.root / PENDING_DIR  # made once: a save asked for it ~6 times (~5 us a Path)
        # RootDir holds no descriptor (each call opens the root afresh), only the root's absolute path: one
        # made here serves every call (a save asked for a new one ~6 times). A relative root is resolved
        # against the working directory of each call, as before, so it gets a new one each time.
        self._fs = RootDir(self.root) if self.root.is_absolute() else None
        # The lease this process holds on ROOT (set by ``lease()``): every commit and delete is fenced by
        # it. None for read-only users (restore on other ranks, the CLI's ls/verify), who change nothing.
        self.owner: HeartbeatLease | None = None

    def fence(self, action: str) -> None:
        """LeaseError unless this process still owns ROOT (a no-op without a lease; see lease.fence)."""
        if self.owner is not None:
            self.owner.fence(action)

    @property
    def fs(self) -> RootDir:
        """ROOT, touched only through the guarded walk: no symlink below it followed (store/rootfs.py)."""
        return self._fs or RootDir(self.root)

    def step_path(self, step: int) -> Path:
        return self.root / step_name(step)

    def ensure_root(self) -> None:
        # Every directory created here gets its parent fsynced: otherwise a power loss after the first
        # commits could lose ROOT's own directory entry, and every checkpoint with it.
        # ROOT and its parents are the user's path (followed as given); .pending is walked, never followed.
        missing = [p for p in (self.root, *self.root.parents) if RootDir(p).lstat("") is None]
        if self.fs.lstat(PENDING_DIR) is None:
            missing.insert(0, self.pending_root)
        try:
            self.fs.make()
            # A .pending that is not a real directory is left alone, reported by clean_pending (saves refuse).
            if self.fs.kind(PENDING_DIR) in (None, "a directory"):
                self.fs.makedirs(PENDING_DIR, parents=False)
            for created in reversed(missing):
                fsync_dir(created.parent)
        except OSError as e:
            raise CheckpointError(f"cannot create checkpoint root {self.root}: {e.strerror or e}") from e

    def check_readable(self) -> None:
        if (st := self.fs.lstat("")) is None:  # the root's own path is the user's: followed (rootfs)
            return
        if describe_mode(st.st_mode) != "a directory":
            raise CheckpointError(f"checkpoint root {self.root} exists but is not a directory")
        if not os.access(self.root, os.R_OK | os.X_OK):
            raise CheckpointError(f"checkpoint root {self.root} is not readable (permission denied)")

    # ---- discovery -----------------------------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        """Steps whose directory holds a manifest, oldest first (manifest not yet parsed)."""
        self.check_readable()
        # A symlinked step-N is never a checkpoint (it would read, and retention delete, elsewhere):
        # dirs_holding opens each with O_NOFOLLOW, from one descriptor of the root (run after every save).
        names = self.fs.dirs_holding(MANIFEST_NAME, lambda name: parse_step(name) is not None)
        return sorted(s for s in map(parse_step, names) if s is not None)

    def read_manifest(self, step: int) -> Manifest:
        try:
            data = self.manifest_bytes(step)
        except OSError as e:
            raise CorruptCheckpointError(
                step, MANIFEST_NAME, f"cannot read manifest ({e.strerror or e})"
            ) from e
        return Manifest.from_json(data, step_hint=step)

    def info(self, step: int, manifest: Manifest) -> CheckpointInfo:
        return CheckpointInfo(
            step=step,
            path=str(self.step_path(step)),
            time=manifest.time,
            bytes=manifest.total_bytes,
            metrics=dict(manifest.metrics),
            world_size=manifest.world_size,
        )

    def verify(self, step: int, files: list[str] | None = None, *, loading: bool = False) -> Manifest:
        """Parse the manifest and check size + crc32c of every listed file (or the subset ``files``).

        Raises CorruptCheckpointError naming the first bad file. ``loading`` changes nothing on a local
        disk: it is read whole (loading reads it again from the page cache)."""
        manifest = self.read_manifest(step)
        names = sorted(manifest.files) if files is None else files
        base, fs = step_name(step), self.fs
        problems: dict[str, str] = {}
        ranges: dict[str, list[tuple[int, int]]] = {}
        for name in names:
            entry = manifest.files[name]
            if problem := root_ops.file_problem(fs, f"{base}/{name}"):
                problems[name] = problem
                continue
            actual = root_ops.lstat_size(fs, f"{base}/{name}")
            if actual != entry.size:
                problems[name] = f"size {actual} != {entry.size} (truncated or extended)"
                continue
            ranges[name] = crc_ranges(entry.size, _VERIFY_THREADS)

        # Every range of every file is one task: a checkpoint's single big file is read by several
        # threads at once (crc32c releases the GIL), and the ranges' checksums are combined.
        workers = min(_VERIFY_THREADS, max(1, sum(len(parts) for parts in ranges.values())))
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as ex:
            futures = {
                name: [
                    (length, ex.submit(root_ops.range_crc32c, fs, f"{base}/{name}", off, length))
                    for off, length in parts
                ]
                for name, parts in ranges.items()
            }
        for name, parts in futures.items():
            value = 0
            for i, (length, fut) in enumerate(parts):
                try:
                    part = fut.result()
                except FileNotFoundError:
                    problems[name] = MISSING
                    break
                except OSError as e:  # unreadable, or replaced by a FIFO/symlink since the lstat above
                    problems[name] = f"cannot read ({e.strerror or e})"
                    break
                except EOFError:
                    problems[name] = "file shrank while being verified (truncated)"
                    break
                value = part if i == 0 else crc32c_combine(value, part, length)
            else:
                crc, expected = crc_hex(value), manifest.files[name].crc32c
                if crc != expected:
                    problems[name] = f"crc32c {crc} != {expected} (contents altered)"
        for name in names:
            if name in problems:
                raise CorruptCheckpointError(step, name, problems[name])
        return manifest

    # ---- saving --------------------------------------------------------------------------------------

    def new_pending(self, step: int, save_id: str) -> Path:
        return self.pending_root / f"{step_name(step)}-{save_id}"

    def commit(self, pending: Path, manifest: Manifest) -> Path:
        """Write the manifest into ``pending`` and move it into place as step-N, durably."""
        with holding(self.root, self.pending_root):  # walks from them (held_dirs.py): renames are inside
            return self._commit(pending, manifest)

    def _commit(self, pending: Path, manifest: Manifest) -> Path:
        write_file_durably(pending / MANIFEST_NAME, manifest.to_json())
        fsync_dir(pending)
        final = self.step_path(manifest.step)
        # Whether (and which) step-N to replace is decided before the fence: an owner frozen after the fence
        # whose root was taken over must find a step-N committed meanwhile in its way, never replace it.
        replacing = _identity(final)
        self.fence(f"committing step {manifest.step}")  # the last moment before it becomes visible
        if replacing is not None:
            self._replace(pending, final, replacing)
        else:
            try:
                self.fs.move(
                    pending, final
                )  # refuses a non-empty step-N (ENOTEMPTY/EEXIST): never replaces one
            except OSError as e:
                # ENOENT: a new owner's clean_pending removed this save as abandoned.
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.ENOENT):
                    raise
                changed = f"{final} or {pending} changed meanwhile ({e.strerror})"
            else:
                changed = ""
            if changed:  # outside the except: the LeaseError is the cause reported, not the OSError
                self._lost(f"committing step {manifest.step}", changed)
            try:
                fsync_dir(self.root)
            except OSError:
                # Not durable, so not committed: take it back out of sight before reporting the failure.
                self.fs.move(final, pending)
                raise
        # Housekeeping only: .pending's entries are never listed, so this cannot un-commit anything.
        with contextlib.suppress(OSError):
            fsync_dir(self.pending_root)
        return final

    def _lost(self, action: str, what: str) -> NoReturn:
        """A step-N changed between this owner's decision and its rename: LeaseError if the root was taken
        over meanwhile (the usual cause), else CheckpointError. Nothing of the other writer's is touched."""
        self.fence(action)
        raise CheckpointError(f"not {action}: {what} (another writer?); left as it is")

    def _replace(self, pending: Path, final: Path, expected: tuple[int, int]) -> None:
        """Swap ``pending`` in for the committed ``final`` that was ``expected`` (its identity) when the
        commit was fenced; a different step-N found there (a new owner's) is put back, untouched."""
        if _rename_exchange(pending, final):
            if _identity(pending) != expected:
                _rename_exchange(pending, final)
                self._lost(f"replacing {final.name}", f"{final} was replaced meanwhile")
            # pending now holds the old copy; it is unlisted, so removing it is safe at any moment.
            try:
                fsync_dir(self.root)
            except OSError:
                _rename_exchange(pending, final)  # the old copy back in place: "older checkpoints intact"
                raise
            remove_tree(pending)
            return
        # No atomic exchange (e.g. NFS): park the old copy where recovery puts it back if we crash before
        # the new one lands.
        parked, fs = self.pending_root / f"{_REPLACED_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}", self.fs
        fs.move(final, parked)
        if _identity(parked) != expected:
            fs.move(parked, final)
            self._lost(f"replacing {final.name}", f"{final} was replaced meanwhile")
        try:
            fs.move(pending, final)
        except OSError:
            fs.move(parked, final)  # the old copy back in place before reporting "not committed"
            raise
        try:
            fsync_dir(self.root)
        except OSError:
            fs.move(final, pending)
            fs.move(parked, final)
            raise
        # The replacement is done: first make the parked copy unrecoverable (recovery puts back only
        # "replaced-" copies), so a failed delete can never resurrect it later.
        doomed = self.pending_root / f"{_DELETING_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        try:
            fs.move(parked, doomed)
        except OSError:
            _remove_manifest_first(parked, expected)
            return
        remove_tree(doomed)

    # ---- the seam SyncSaver/Restorer use (RemoteLayout has the same methods) ---------------------------

    def make_writer(self, pending: Path, *, thread_count: int = 1) -> SafepointWriter:
        return SafepointWriter(pending, thread_count=thread_count, root=self.fs)

    def written_sizes(self, pending: Path) -> dict[str, int]:
        """{name: size} of the files a save left in ``pending`` (what rank 0 can see)."""
        fs = around(pending / MANIFEST_NAME, self.fs)  # walked from ROOT when under it
        with contextlib.suppress(FileNotFoundError):
            stats = {n: fs.lstat(pending / n) for n in fs.listdir(pending)}
            return {n: st.st_size for n, st in stats.items() if st is not None and root_ops.is_regular(st)}
        return {}

    def discard(self, pending: Path) -> None:
        remove_tree(pending)

    def manifest_bytes(self, step: int) -> bytes:
        """The manifest's bytes: a regular file reached without a symlink, at most MAX_MANIFEST_BYTES (one
        linked to /dev/zero or a FIFO would be read forever, one linked elsewhere read from there)."""
        with os.fdopen(self.fs.open_read(f"{step_name(step)}/{MANIFEST_NAME}"), "rb") as f:
            data = read_up_to(f, MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            raise OSError(errno.EFBIG, f"larger than {MAX_MANIFEST_BYTES >> 20} MiB, not a manifest")
        return data

    def read_metadata(self, step: int, manifest: Manifest) -> Metadata:
        """``.metadata``, its bytes checked against ``manifest`` and its structure checked (guard)."""
        size = manifest.files[METADATA_NAME].size if METADATA_NAME in manifest.files else 0
        try:
            with os.fdopen(self.fs.open_read(f"{step_name(step)}/{METADATA_NAME}"), "rb") as f:
                data = read_up_to(f, size + 1)  # never more than the manifest allows, whatever the file holds
        except OSError as e:
            raise CorruptCheckpointError(step, METADATA_NAME, f"cannot read ({e.strerror or e})") from None
        return load_checked_metadata(step, data, manifest.expected())

    def make_reader(self, step: int, metadata: Metadata | None, manifest: Manifest) -> SafeReader:
        expected = manifest.expected()
        return SafeReader(self.step_path(step), metadata=metadata, expected=expected, step=step, root=self.fs)

    def lease(self, stale_after_s: float, job: str | None = None) -> Lease:
        """A lease on ROOT (held for ``job``: store/job.py); once acquired, it fences commits and deletes."""
        self.owner = Lease(self.root, stale_after_s=stale_after_s, job=job)
        return self.owner

    # ---- removal and cleanup -------------------------------------------------------------------------

    def remove(self, step: int) -> None:
        """Delete a committed checkpoint; crash-safe (it is listed intact, or not at all)."""
        with holding(self.root, self.pending_root):  # as commit's
            self._remove(step)

    def _remove(self, step: int) -> None:
        src, fs = self.step_path(step), self.fs
        # One lstat gives the kind and the identity (a second walk took the same stat again).
        st = fs.lstat(src)
        if st is not None and (problem := describe_mode(st.st_mode)) != "a directory":
            raise OSError(f"not deleting {src}: it is {problem}, not a checkpoint directory")
        expected = None if st is None else (st.st_dev, st.st_ino)  # before the fence: what was decided
        self.fence(f"deleting step {step}")
        doomed = self.pending_root / f"{_DELETING_PREFIX}{src.name}-{uuid.uuid4().hex[:8]}"
        try:  # the move's walk refuses a .pending that is no real directory (ELOOP, ENOTDIR): moved nothing
            fs.move(src, doomed)
        except OSError:
            if fs.isdir(PENDING_DIR):  # asked only now: one walk less per delete (every save's retention)
                raise
            if not _remove_manifest_first(src, expected):  # in place: via a symlinked .pending, outside ROOT
                self._lost(f"deleting step {step}", f"{src} was replaced meanwhile")
            return
        if _identity(doomed) != expected:  # a step-N committed since the fence (a new owner's): put back
            fs.move(doomed, src)
            self._lost(f"deleting step {step}", f"{src} was replaced meanwhile")
        fsync_dir(self.root)
        remove_tree(doomed)

    def clean_pending(self) -> list[str]:
        """Run by a new owner: recover parked replacements, delete abandoned saves. Returns what it did."""
        done: list[str] = []
        fs = self.fs
        if (problem := fs.kind(PENDING_DIR)) not in (None, "a directory"):
            msg = f"safepoint: {self.pending_root} is {problem}, not a directory; left alone (remove it)"
            warnings.warn(msg, UserWarning, stacklevel=2)
            log.warning(msg)
            return [msg]
        entries = list(self._pending_entries())
        if entries:
            self.fence("cleaning up abandoned saves")
        for entry in entries:
            if (original := parked_step_name(entry.name)) is not None:  # anything else is abandoned
                target = self.root / original
                if (
                    fs.kind(entry) == "a directory"
                    and fs.kind(target) in (None, "a directory")
                    and not fs.isfile(target / MANIFEST_NAME)
                    and fs.isfile(entry / MANIFEST_NAME)
                ):
                    remove_tree(target)
                    fs.move(entry, target)
                    fsync_dir(self.root)
                    done.append(f"recovered {original} from an interrupted replacement")
                    continue
                if (
                    fs.kind(entry) == "a directory"
                    and (odd := fs.kind(target)) not in (None, "a directory")
                    and fs.isfile(entry / MANIFEST_NAME)
                ):
                    # The parked copy may be the only good one of that step; whatever stands in its place
                    # (a symlink, a file) is not ours to follow or replace. Keep both and say so.
                    msg = (
                        f"safepoint: {target} is {odd}, not a checkpoint directory; kept the parked copy "
                        f"{entry} (move it back by hand)"
                    )
                    warnings.warn(msg, UserWarning, stacklevel=2)
                    log.warning(msg)
                    done.append(msg)
                    continue
            done.append(remove_tree(entry) or f"removed abandoned {entry.name}")
        return done

    def _pending_entries(self) -> Iterator[Path]:
        yield from (self.pending_root / name for name in self.fs.listdir(PENDING_DIR))
