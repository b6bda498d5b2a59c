"""The layout and commit protocol on object stores (any fsspec URL: s3://, gs://, az://, file://, ...).

    ROOT/step-<N>/           data objects (a plain DCP directory) + safepoint.json, the manifest
    ROOT/.pending/<name>/    a re-save of a step that is already committed, staged (see commit)
    ROOT/.lease              the owner (S3, GCS, Azure: conditional writes; see lease.py, conditional.py)

Stores cannot rename a directory atomically, so a step is committed by its manifest alone: data objects go
in place under ``step-N/``, each is confirmed (size, and crc32c: S3's own CRC32C, or GCS's, or by reading
where that is cheap), and only then is ``safepoint.json`` written. Deleting removes the manifest first.
A reader trusts a step only if its manifest parses and every listed object matches it: the same rule and
the same ``Manifest`` as on a local disk.

Re-saving a committed step cannot overwrite it in place. The new copy is written under
``.pending/step-N-<id>/`` with its own manifest; then the old manifest is deleted, the objects are copied
server-side into ``step-N/`` and proven as any copy is (never by size), and the new manifest is written. In
that window step N is not listed, but a complete copy always exists, and a new owner finishes the promotion
(``clean_pending``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import posixpath
import re
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from safepoint.errors import CheckpointError, CorruptCheckpointError, LeaseError, StoreReadError
from safepoint.remote import rootstore
from safepoint.remote.cleanup import clean_pending
from safepoint.remote.conditional import create_if_absent
from safepoint.remote.confirmed import confirm
from safepoint.remote.incremental_copy import proven_copy
from safepoint.remote.io import SafeStoreReader, StoreWriter
from safepoint.remote.open import open_store
from safepoint.remote.retry import is_transient, retry
from safepoint.remote.upload import FileCopy, TransferOptions, UploadError
from safepoint.store import posix_layout
from safepoint.store.file_lease import Lease
from safepoint.store.guard import STEP_PATTERN, STEP_PREFIX
from safepoint.store.manifest import MANIFEST_NAME, Manifest, Parts
from safepoint.store.metadata_check import load_checked_metadata
from safepoint.store.posix_layout import PENDING_DIR, CheckpointInfo, step_name
from safepoint.store.rootfs import RootDir
from safepoint.store.storage import METADATA_NAME

log = logging.getLogger("safepoint")
_MANIFEST_KEY = re.compile(rf"^({STEP_PATTERN})/" + re.escape(MANIFEST_NAME) + "$")


def is_url(root: object) -> bool:
    return isinstance(root, str) and "://" in root


class RemoteLayout:
    """A checkpoint root on an object store: the same methods as ``Layout`` where a store has them."""

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        transfer: TransferOptions | None = None,
        deep_verify: bool = False,
    ) -> None:
        """``deep_verify``: verify() reads every byte even where the store reports a checksum."""
        self.store, self.base = open_store(url, storage_options, transfer)
        self.root = self.store.url(self.base)
        self.deep_verify = deep_verify
        self.unguarded = False
        self.owner: Any = None  # the lease this process holds here (set by ``lease()``): fences changes
        # Replacements that failed after the old manifest was deleted: staged prefix -> its manifest. Only
        # rolling forward brings the step back (its old data is overwritten): the next save finishes it.
        self._unfinished: dict[str, Manifest] = {}
        # In-place save prefixes whose step another writer committed meanwhile (commit found its manifest).
        self._not_ours: set[str] = set()

    def _p(self, *parts: str) -> str:
        return posixpath.join(self.base, *parts)

    def fence(self, action: str) -> None:
        """LeaseError unless this process still owns the root (a no-op without a lease; see lease.fence)."""
        if self.owner is not None:
            self.owner.fence(action)

    def step_path(self, step: int) -> str:
        return self.store.url(self._p(step_name(step)))

    @property
    def pending_key(self) -> str:
        return self._p(PENDING_DIR)

    def step_key(self, step: int) -> str:
        return self._p(step_name(step))

    def ensure_root(self) -> None:
        try:
            self.store.check_root(self.base)
        except (OSError, UploadError) as e:
            raise CheckpointError(f"cannot use checkpoint root {self.root}: {e}") from e

    def check_readable(self) -> None:
        pass

    # ---- discovery --------------------------------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        """Steps whose manifest object exists, oldest first (manifest not yet parsed). One listing."""
        self._roll_forward()
        found = (_MANIFEST_KEY.match(rel) for rel in self.store.sizes(self.base))
        return sorted(int(m.group(1).removeprefix(STEP_PREFIX)) for m in found if m)

    def manifest_bytes(self, step: int) -> bytes:
        """The manifest's bytes, at most MAX_MANIFEST_BYTES (as a local root reads it: one byte more is
        fetched, never a hostile object of gigabytes); FileNotFoundError where it is missing, larger or
        empty (a corrupt step), OSError where the store failed the read."""
        try:
            data = self.store.get_bytes(
                self._p(step_name(step), MANIFEST_NAME), limit=posix_layout.MAX_MANIFEST_BYTES
            )
        except UploadError as e:
            raise OSError(str(e)) from e
        if len(data) > posix_layout.MAX_MANIFEST_BYTES:
            raise FileNotFoundError(
                f"larger than {posix_layout.MAX_MANIFEST_BYTES >> 20} MiB, not a manifest"
            )
        return data

    def read_manifest(self, step: int) -> Manifest:
        try:
            data = self.manifest_bytes(step)
        except FileNotFoundError as e:
            raise CorruptCheckpointError(step, MANIFEST_NAME, f"cannot read manifest ({e})") from e
        except OSError as e:  # the store failed the read (manifest_bytes: its UploadError)
            raise StoreReadError(step, MANIFEST_NAME, f"cannot read manifest ({e})") from e
        return Manifest.from_json(data, step_hint=step)

    def info(self, step: int, manifest: Manifest) -> CheckpointInfo:
        return CheckpointInfo(
            step=step,
            path=self.step_path(step),
            time=manifest.time,
            bytes=manifest.total_bytes,
            metrics=dict(manifest.metrics),
            world_size=manifest.world_size,
        )

    def verify(self, step: int, files: list[str] | None = None, *, loading: bool = False) -> Manifest:
        """Parse the manifest and check every listed object (or ``files``): size, then crc32c.

        The crc32c is the store's own where it keeps one (S3 CRC32C, GCS crc32c), else the bytes are read;
        ``loading``: the checkpoint is about to be loaded, and the reader checks every byte it reads against
        the manifest (SafeStoreReader), so no object is read here (reading it here too would download the
        checkpoint twice). Raises CorruptCheckpointError naming the first bad file (in name order).
        """
        manifest = self.read_manifest(step)
        names = sorted(manifest.files) if files is None else files
        base = self.step_key(step)

        def check(name: str) -> str | None:
            entry = manifest.files[name]
            return self.store.check(
                posixpath.join(base, name),
                entry.size,
                entry.crc32c,
                parts=entry.parts,
                read=not loading,
                deep=self.deep_verify and not loading,
            )

        try:
            problems = self.store._parallel(check, names)
        except UploadError as e:
            raise StoreReadError(step, None, f"cannot read from the store ({e})") from e
        for name, problem in zip(names, problems, strict=True):
            if problem:
                raise CorruptCheckpointError(step, name, problem)
        return manifest

    def read_metadata(self, step: int, manifest: Manifest) -> Metadata:
        """``.metadata``, its bytes checked against ``manifest`` and its structure checked (guard): an
        absolute storage path would otherwise read another bucket with the job's credentials."""
        try:
            data = self.store.get_bytes(self._p(step_name(step), METADATA_NAME))
        except FileNotFoundError as e:
            raise CorruptCheckpointError(step, METADATA_NAME, f"cannot read ({e})") from None
        except (UploadError, OSError) as e:  # the store failed the read
            raise StoreReadError(step, METADATA_NAME, f"cannot read ({e})") from None
        return load_checked_metadata(step, data, manifest.expected())

    def read_range(self, step: int, name: str, offset: int, size: int) -> bytes:
        """``size`` bytes of step's object ``name`` from ``offset`` (one ranged read; verify's item check)."""
        path = self._p(step_name(step), name)
        guard, end = self.store.guard, offset + size
        if guard is not None:  # a file:// root: a regular file below it, never through a symlink
            data = rootstore.read_range(guard, path, offset, end) if size else b""
        elif size:  # under the store's retries, as every other request (a 503 here failed verify)
            read = functools.partial(self.store.fs.cat_file, path, start=offset, end=end)
            try:
                data = retry(f"read of {self.store.url(path)}", read, self.store.cfg)
            except UploadError as e:
                if not is_transient(e.__cause__ or e):  # missing, refused: the object, not the store's load
                    raise OSError(str(e)) from e
                raise  # the store failed past every retry (its UploadError: not the checkpoint's damage)
        else:
            data = b""
        if len(data) != size:
            raise OSError(
                f"{self.store.url(path)} ended at byte {offset + len(data)} (changed while verified?)"
            )
        return bytes(data)

    def make_reader(self, step: int, metadata: Metadata | None, manifest: Manifest) -> SafeStoreReader:
        self.store.fs.invalidate_cache(self.step_key(step))  # s3fs checks cached ETags on open
        return SafeStoreReader(
            self.store, self.step_key(step), metadata=metadata, expected=manifest.expected(), step=step
        )

    # ---- saving -----------------------------------------------------------------------------------------

    def new_pending(self, step: int, save_id: str) -> str:
        """Where a save of ``step`` writes: in place, unless a committed copy is there (then staged)."""
        self._roll_forward()
        try:
            self.store.stored_checksum(self._p(step_name(step), MANIFEST_NAME))
        except FileNotFoundError:
            self.store.confirmed.begin(self.step_key(step))  # (a staged prefix is new: nothing under it)
            return self.step_key(step)
        return self._p(PENDING_DIR, f"{step_name(step)}-{save_id}")

    def make_writer(self, pending: str, *, thread_count: int = 1) -> StoreWriter:
        return StoreWriter(self.store, pending, thread_count=thread_count)

    def written_sizes(self, pending: str) -> dict[str, int]:
        return {k: v for k, v in self.store.sizes(pending).items() if "/" not in k}

    def put_files(
        self, pending: str, files: list[tuple[str, str, int, str]], *, root: str | None = None
    ) -> dict[str, Parts]:
        """Upload local files (path, name, size, crc32c; opened walking from ``root``, the local root) into
        ``pending``, each verified by the store; {name: parts} for the manifest (``Manifest.with_parts``)."""
        copies = [FileCopy(lp, posixpath.join(pending, n), s, c, root) for lp, n, s, c in files]
        done = self.store.put_files(copies)
        return {posixpath.basename(path): parts for path, parts in done.items()}

    def copy_files(self, step: int, pending: str, files: list[tuple[str, int, str]]) -> list[str]:
        """Copy committed ``step``'s objects (name, size, crc32c) into ``pending`` server-side, each proven
        (incremental_copy.proven_copy); the names that could not be (the caller uploads those)."""
        source = self.step_key(step)

        def one(item: tuple[str, int, str]) -> str | None:
            name, size, crc = item
            src, dst = posixpath.join(source, name), posixpath.join(pending, name)
            if problem := proven_copy(self.store, src, dst, size, crc):
                log.warning("safepoint: server-side copy of %s failed (%s); uploading it", name, problem)
            return name if problem else None

        return [n for n in self.store._parallel(one, files) if n]

    def commit(self, pending: str, manifest: Manifest, *, confirmed: bool = False) -> str:
        """Confirm every object against ``manifest``, then write the manifest (then promote if staged).
        ``confirmed``: every object was confirmed as it was uploaded (``put_files``): not checked again."""
        final = self.step_key(manifest.step)
        if not confirmed:  # in place: asked again, every object (remote/confirmed.py: confirm's trust)
            confirm(self.store, pending, manifest, trust=pending != final)
        self.fence(f"committing step {manifest.step}")  # the manifest write is the commit
        if pending == final:
            self._create_manifest(final, manifest)
        else:
            self.store.put_bytes(posixpath.join(pending, MANIFEST_NAME), manifest.to_json())
            self._replace(pending, manifest)
        return self.store.url(final)

    def _create_manifest(self, prefix: str, manifest: Manifest) -> None:
        """Write ``prefix``'s manifest only if none is there (conditional.create_if_absent): an owner frozen
        after its fence, whose root was taken over, never replaces a manifest the new owner wrote."""
        path = posixpath.join(prefix, MANIFEST_NAME)
        self.store.sync_dirs(prefix)  # a file:// root: the files' names on its disk before the manifest's
        created = create_if_absent(self.store, path, manifest.to_json())
        self.store.sync_dirs(prefix)  # ... and the manifest's: the commit itself
        if not created:
            self._not_ours.add(prefix)  # discard() must leave the other writer's step alone
            self.fence(f"committing step {manifest.step}")  # a takeover is the usual cause: say so
            raise UploadError(
                f"not committing step {manifest.step}: {self.store.url(path)} was written by another writer "
                "meanwhile; left as it is"
            )

    def _promote(self, staged: str, manifest: Manifest) -> None:
        """Replace a committed step by a staged, confirmed copy; never without a complete copy somewhere."""
        final = self.step_key(manifest.step)
        log.info("safepoint: replacing committed %s on the store", self.store.url(final))
        self.store.delete([posixpath.join(final, MANIFEST_NAME)])  # step N is unlisted from here ...
        self._unfinished[staged] = manifest  # ... and a failure from here on must keep the staged copy
        stale = [posixpath.join(final, k) for k in self.store.sizes(final) if k not in manifest.files]
        self.store.delete(stale)
        got = manifest.files
        copy = self.store.copy
        self.store._parallel(
            lambda n: copy(posixpath.join(staged, n), posixpath.join(final, n), got[n].size, got[n].crc32c),
            sorted(got),
        )
        confirm(self.store, final, manifest, prove=True)
        self.store.sync_dirs(final)  # as _create_manifest
        created = create_if_absent(self.store, posixpath.join(final, MANIFEST_NAME), manifest.to_json())
        self.store.sync_dirs(final)
        if not created:
            self._unfinished.pop(staged, None)  # another writer committed step N meanwhile: theirs stays
            self.fence(f"committing step {manifest.step}")
            raise UploadError(f"not replacing step {manifest.step}: another writer committed it meanwhile")
        self._unfinished.pop(staged, None)  # ... to here
        self.discard(staged)

    def _replace(self, staged: str, manifest: Manifest) -> None:
        try:
            self._promote(staged, manifest)
        except (CheckpointError, OSError) as e:
            if staged not in self._unfinished:
                raise  # the old copy's manifest is still there: nothing changed, the staged copy may go
            raise UploadError(
                f"replacing committed step {manifest.step} failed midway ({e}): its old copy is unlisted and "
                f"partly overwritten; the new copy is complete at {self.store.url(staged)} and the next save "
                "(or the next owner of this root) finishes the replacement with it"
            ) from e

    def _roll_forward(self) -> None:
        """Finish replacements that failed midway (``_unfinished``); those that fail again stay queued."""
        for staged, manifest in list(self._unfinished.items()):
            try:
                self._promote(staged, manifest)
                log.warning("safepoint: finished the interrupted replacement of step %d", manifest.step)
            except (CheckpointError, OSError) as e:
                log.warning("safepoint: still cannot finish replacing step %d: %s", manifest.step, e)

    def discard(self, pending: str, *, manifest_deleted: bool = False) -> None:
        """Delete an uncommitted save's objects: its manifest first, if one got written (``manifest_deleted``:
        the caller just did), and the rest only once that is gone (a manifest must never outlive the data it
        lists). Never a staged copy that an unfinished replacement needs."""
        if pending in self._unfinished:
            log.warning("safepoint: keeping %s to finish a replacement with it", self.store.url(pending))
            return
        if pending in self._not_ours or not self._still_owner(pending):
            # Saved in place (step-N/): once another writer committed there, or took the root over, the
            # objects under it may be theirs. The owner's clean_pending removes what is left of ours.
            self._not_ours.discard(pending)
            log.warning("safepoint: not cleaning up %s: another writer may own it", self.store.url(pending))
            return
        try:
            if not manifest_deleted:
                self.store.delete([posixpath.join(pending, MANIFEST_NAME)])
            rest = [posixpath.join(pending, k) for k in self.store.sizes(pending) if k != MANIFEST_NAME]
            self.store.delete(rest)
        except (UploadError, FileNotFoundError) as e:
            log.warning("safepoint: could not clean up %s: %s", self.store.url(pending), e)
            return
        if self.store.local:
            # A directory as the durable tier: step-N/ left empty would be listed as a partial save forever.
            with contextlib.suppress(OSError):  # only an empty real directory goes; anything else stays
                RootDir(self.base).remove_empty_dir(posixpath.relpath(pending, self.base))

    def _still_owner(self, prefix: str) -> bool:
        """Whether this process may delete under an in-place save ``prefix``: it holds the root's lease
        (or none is used). Staged copies under .pending/ are unique to one save and always ours."""
        if prefix.startswith(self.pending_key + "/"):
            return True
        try:
            self.fence(f"cleaning up {self.store.url(prefix)}")
        except LeaseError:
            return False
        return True

    # ---- removal and cleanup ----------------------------------------------------------------------------

    def remove(self, step: int) -> None:
        """Delete a committed checkpoint: the manifest first (then it is no longer listed), then the data.

        Raises OSError if the manifest could not be deleted, as ``Layout.remove`` does: retention treats a
        failed removal as a cleanup to retry, never as a failure of the save that was just committed."""
        self.fence(f"deleting step {step}")
        try:
            self.store.delete([self._p(step_name(step), MANIFEST_NAME)])
        except UploadError as e:
            raise OSError(f"cannot delete step {step} from {self.root}: {e}") from e
        self.discard(self.step_key(step), manifest_deleted=True)

    def clean_pending(self) -> list[str]:
        """Run by the owner: finish interrupted replacements, delete uncommitted data. Returns what it did
        (remote/cleanup.py)."""
        return clean_pending(self)

    def lease(self, stale_after_s: float, job: str | None = None) -> Any:
        """The owner's lease on this root: S3 conditional writes, O_EXCL for file://; None elsewhere (then
        ``clean_pending`` leaves uncommitted objects alone: they may be another writer's save in flight)."""
        from safepoint.remote.object_lease import RemoteLease

        if self.store.local:
            self.owner = Lease(Path(self.base), stale_after_s=stale_after_s, job=job)
        else:
            self.owner = RemoteLease.for_layout(self, stale_after_s, job)
            self.unguarded = self.owner is None
        return self.owner

    def object_key(self, step: int, name: str) -> str:
        return self._p(step_name(step), name)
