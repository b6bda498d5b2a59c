"""Checkpoint roots as the ``safepoint`` command line sees them: find, list, verify and prune steps.

The logic behind the CLI lives in the ``tools*`` modules, on top of the same modules the manager uses
(Layout for the layout and commit protocol, SafeReader/SafeLoadPlanner for reads, SyncSaver for writes, the
retention policies, the lease); cli*.py only parse arguments and render. This one works on manifests and
file checksums and never unpickles anything. tools_read.py reads a checkpoint's contents (``.metadata``
through the restricted unpickler, every item with ``weights_only=True``), tools_convert.py exports and
imports single files, tools_diff.py compares two states.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from safepoint.errors import CheckpointError, CorruptCheckpointError, LeaseError, StoreReadError
from safepoint.policy.rules import Retention
from safepoint.remote.object_layout import RemoteLayout, is_url
from safepoint.remote.upload import UploadError
from safepoint.store.guard import MISSING, parse_step, real_dir_problem
from safepoint.store.heartbeat import DEFAULT_STALE_AFTER_S
from safepoint.store.item_check import items_problem, local_ranges
from safepoint.store.manifest import MANIFEST_NAME, Manifest
from safepoint.store.node_map import node_copy
from safepoint.store.posix_layout import PENDING_DIR, CheckpointInfo, Layout, step_name
from safepoint.store.storage import METADATA_NAME

OK = "ok"
CORRUPT = "corrupt"
PARTIAL = "partial"
IGNORED = "ignored"  # a step-N entry that is not a real directory (a symlink, a file): never followed
TIER_LOCAL = "local"
TIER_NODE = "node"  # one node's share of a checkpoint, in that node's local_root (per-node local tiers)
TIER_DURABLE = "durable"  # a URL root (object store): ls and verify read it through RemoteLayout


# ---- root and step discovery -------------------------------------------------------------------------


def open_root(root: str, *, must_exist: bool = True) -> Layout:
    """A Layout for a local root; a clear error for URLs and missing or unreadable roots."""
    path = root[len("file://") :] if root.startswith("file://") else root
    if "://" in path:
        raise CheckpointError(f"{root}: this command reads local roots only (ls and verify also read URLs)")
    layout = Layout(path)
    if must_exist and layout.fs.lstat("") is None:
        raise CheckpointError(f"checkpoint root {path} does not exist")
    layout.check_readable()
    return layout


def open_any_root(root: str) -> Layout | RemoteLayout:
    """``open_root``, or for a URL a RemoteLayout that verifies by reading every byte (endpoint and
    credentials come from the environment and AWS config, e.g. AWS_ENDPOINT_URL_S3, AWS_PROFILE)."""
    if is_url(root) and not root.startswith("file://"):
        try:
            return RemoteLayout(root, deep_verify=True)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    return open_root(root)


def _remote_steps(layout: RemoteLayout) -> dict[int, tuple[str, int, bool]]:
    """step -> (URL, bytes, has a manifest) for every ``step-N/`` prefix, from one listing."""
    out: dict[int, tuple[str, int, bool]] = {}
    for key, size in layout.store.sizes(layout.base).items():
        top, _, rest = key.partition("/")
        step = parse_step(top)
        if step is not None and rest:
            _, total, has = out.get(step, (layout.step_path(step), 0, False))
            out[step] = (layout.step_path(step), total + size, has or rest == MANIFEST_NAME)
    return dict(sorted(out.items()))


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One ``step-N`` directory as ``ls`` reports it."""

    step: int
    path: str
    status: str
    bytes: int
    time: float | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    world_size: int | None = None
    reason: str | None = None
    tier: str = TIER_LOCAL

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _dir_bytes(path: Path) -> int:
    total = 0
    for top, _dirs, files in os.walk(path):  # os.walk never descends into a symlinked directory
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(top, name))
                total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def step_dirs(layout: Layout | RemoteLayout) -> dict[int, Path | str]:
    """Every ``step-N`` directory, committed or not (Layout.committed_steps lists only committed ones)."""
    if isinstance(layout, RemoteLayout):
        return {step: url for step, (url, _, _) in _remote_steps(layout).items()}
    out: dict[int, Path | str] = {}
    for name in layout.fs.listdir():
        step = parse_step(name)
        if step is not None and layout.fs.isdir(name):
            out[step] = layout.root / name
    return dict(sorted(out.items()))


def not_directories(layout: Layout) -> dict[int, str]:
    """step -> what it is, for every ``step-N`` entry that is not a real directory (never followed)."""
    out = {}
    for name in layout.fs.listdir():
        step = parse_step(name)
        if step is not None and (kind := layout.fs.kind(name)) not in (None, "a directory"):
            out[step] = kind
    return out


def scan(layout: Layout | RemoteLayout, *, verify: bool = False) -> list[Entry]:
    """Every step directory, oldest first: ok, corrupt (manifest, or with ``verify`` a file) or partial.

    ``path`` is absolute for a local root and the URL for an object-store root.
    """
    entries = []
    if isinstance(layout, RemoteLayout):
        tier, found = TIER_DURABLE, _remote_steps(layout)
    else:
        # Absolute paths: a script reading `ls --json` may run from another directory than ours.
        tier = TIER_LOCAL
        found = {
            s: (os.path.abspath(p), -1, layout.fs.lexists(f"{step_name(s)}/{MANIFEST_NAME}"))
            for s, p in step_dirs(layout).items()
        }
    if isinstance(layout, Layout):
        for step, what in not_directories(layout).items():
            why = f"{what}, not a directory: never followed, listed or deleted"
            entries.append(Entry(step, os.path.abspath(layout.step_path(step)), IGNORED, 0, reason=why))
    for step, (path, size, committed) in found.items():
        nbytes = size if size >= 0 else _dir_bytes(Path(path))
        if not committed:
            # A save that never committed, or a removal interrupted mid-way: never loaded by restore.
            entries.append(
                Entry(step, path, PARTIAL, nbytes, reason="no manifest (never committed)", tier=tier)
            )
            continue
        try:
            manifest = layout.read_manifest(step)
        except StoreReadError as e:
            raise _store_failed(e) from None
        except CorruptCheckpointError as e:
            entries.append(Entry(step, path, CORRUPT, nbytes, reason=_where(e), tier=tier))
            continue
        info = layout.info(step, manifest)
        status, reason = OK, None
        where = tier
        if verify:
            try:
                layout.verify(step)
            except StoreReadError as e:
                raise _store_failed(e) from None
            except CorruptCheckpointError as e:
                status, reason = CORRUPT, _where(e)
                if e.reason == MISSING and isinstance(layout, Layout) and _intact_node_copy(layout, manifest):
                    status, reason, where = OK, None, TIER_NODE
        entries.append(
            Entry(step, path, status, info.bytes, info.time, info.metrics, info.world_size, reason, where)
        )
    return sorted(entries, key=lambda e: e.step)


def _intact_node_copy(layout: Layout, manifest: Manifest) -> bool:
    """A node's copy (node_copy_of) whose files here all verify."""
    base = layout.step_path(manifest.step)
    absent = {n for n in manifest.files if not os.path.lexists(base / n)}
    if node_copy(manifest.extra, manifest.world_size, manifest.files, absent) is None:
        return False
    try:
        layout.verify(manifest.step, files=sorted(set(manifest.files) - absent))
    except CorruptCheckpointError:
        return False
    return True


def pending_problem(layout: Layout | RemoteLayout) -> str | None:
    """A line for ``ls`` if ``.pending`` is not a real directory (never followed, never cleaned)."""
    if isinstance(layout, RemoteLayout) or not (what := real_dir_problem(layout.pending_root)):
        return None
    return f"{layout.pending_root} is {what}, not a directory: never followed or cleaned; remove it by hand"


def pending_saves(layout: Layout | RemoteLayout) -> list[str]:
    if isinstance(layout, RemoteLayout):
        return sorted({k.split("/")[0] for k in layout.store.sizes(layout.pending_key)})
    if real_dir_problem(layout.pending_root):
        return []
    try:
        return layout.fs.listdir(PENDING_DIR)
    except OSError:
        return []


def resolve_step(layout: Layout | RemoteLayout, step: int | None) -> int:
    """``step`` if it is committed, else the newest committed step; a clear error otherwise."""
    committed = layout.committed_steps()
    if step is None:
        if not committed:
            raise CheckpointError(f"no committed checkpoint in {layout.root}")
        return committed[-1]
    if step not in committed:
        why = ""
        if isinstance(layout, Layout) and layout.fs.isdir(step_name(step)):
            why = f" ({layout.step_path(step)} has no manifest: a save that never committed)"
        shown = committed[-10:] if committed else "none"
        raise CheckpointError(
            f"no committed checkpoint for step {step} in {layout.root}{why}; available: {shown}"
        )
    return step


# ---- verification ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Problem:
    step: int
    file: str | None
    reason: str

    def __str__(self) -> str:
        return f"step {self.step}: {self.file or 'checkpoint'}: {self.reason}"


def _store_failed(e: StoreReadError) -> CheckpointError:
    """An error of the store (exit 2), not a damaged checkpoint (exit 1): the store failed a read."""
    return CheckpointError(f"cannot check step {e.step}: the store failed: {e.reason}")


def _where(e: CorruptCheckpointError) -> str:
    return f"{e.file}: {e.reason}" if e.file else e.reason


def verify_step(
    layout: Layout | RemoteLayout, step: int, on_file: Callable[[str, int], None] | None = None
) -> tuple[Manifest | None, list[Problem]]:
    """Check every file of ``step`` (size + crc32c) and report all problems, not only the first.

    Each file goes through Layout.verify so the checking rule lives in one place; ``on_file(name, size)``
    is called as each file finishes (progress). Files go one at a time: Layout.verify already reads a
    file's ranges in parallel, and a second pool on top would only oversubscribe the disk.
    """
    try:
        manifest = layout.read_manifest(step)
    except StoreReadError as e:
        raise _store_failed(e) from None
    except CorruptCheckpointError as e:
        return None, [Problem(step, e.file, e.reason)]
    problems: list[Problem] = []
    for name in sorted(manifest.files):
        try:
            layout.verify(step, files=[name])
        except StoreReadError as e:
            raise _store_failed(e) from None
        except CorruptCheckpointError as e:
            problems.append(Problem(step, e.file or name, e.reason))
        except KeyError:  # the manifest was replaced while we read it (a concurrent save of this step)
            problems.append(Problem(step, name, "the manifest changed during verification; run verify again"))
        if on_file is not None:
            on_file(name, manifest.files[name].size)
    # A node-local tier's copy holds its node's ranks' files only: those must be intact, item by item.
    absent = {p.file for p in problems if p.reason == MISSING and p.file}
    held = node_copy_of(layout, manifest, problems)
    only = None if held is None else [n for n in manifest.files if n not in absent]
    if METADATA_NAME not in manifest.files:
        problems.append(Problem(step, METADATA_NAME, "not listed in the manifest (not a DCP checkpoint)"))
    elif not problems or held is not None:
        # Checksums are no MAC: a forged .metadata whose storage paths leave the checkpoint, or whose offsets
        # lie outside its files, verifies byte for byte. Restore refuses it; so must verify (and prune, which
        # must never count it as the newest intact checkpoint).
        try:
            metadata = layout.read_metadata(step, manifest)
        except StoreReadError as e:
            raise _store_failed(e) from None
        except CorruptCheckpointError as e:
            problems.append(Problem(step, e.file or METADATA_NAME, e.reason))
        else:
            # Offsets re-pointed inside a verified data file pass both checks above; restore finds no record
            # of what .metadata promises there and falls back, so verification must say so too.
            if found := _structure_problem(layout, step, metadata, only):
                problems.append(Problem(step, *found))
    return manifest, problems


def _structure_problem(
    layout: Layout | RemoteLayout, step: int, metadata: Metadata, only: list[str] | None = None
) -> tuple[str, str] | None:
    """(file, reason) if an item's bytes are not what ``.metadata`` says (item_check), else None."""
    try:
        if isinstance(layout, RemoteLayout):
            return items_problem(metadata, lambda name, off, n: layout.read_range(step, name, off, n), only)
        with local_ranges(layout.step_path(step)) as read:
            return items_problem(metadata, read, only)
    except UploadError as e:  # the store failed a read past every retry: its error, not damage
        raise CheckpointError(f"cannot check step {step}: the store failed: {e}") from None
    except OSError as e:
        return METADATA_NAME, f"cannot read the items it describes ({e})"


def node_copy_of(
    layout: Layout | RemoteLayout, manifest: Manifest, problems: list[Problem]
) -> list[str] | None:
    """The nodes whose share a local root holds, when ``problems`` are exactly the other nodes' files
    missing (a per-node local tier, store/node_map.py ``node_copy``); None otherwise. Never for a URL root:
    the durable tier holds every file."""
    if isinstance(layout, RemoteLayout) or not problems or any(p.reason != MISSING for p in problems):
        return None
    absent = {p.file for p in problems if p.file}
    return node_copy(manifest.extra, manifest.world_size, manifest.files, absent)


def require_intact(layout: Layout, step: int, on_file: Callable[[str, int], None] | None = None) -> Manifest:
    manifest, problems = verify_step(layout, step, on_file)
    if problems or manifest is None:
        first = problems[0]
        more = f" (+{len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise CorruptCheckpointError(step, first.file, first.reason + more)
    return manifest


# ---- prune -------------------------------------------------------------------------------------------


def history(layout: Layout) -> list[CheckpointInfo]:
    """Committed checkpoints whose manifest parses; others are never counted as kept or deleted."""
    out = []
    for s in layout.committed_steps():
        try:
            out.append(layout.info(s, layout.read_manifest(s)))
        except CheckpointError:
            continue
    return out


def prune(
    layout: Layout, retention: Retention, *, dry_run: bool, force: bool = False
) -> tuple[list[int], list[int], list[int]]:
    """(kept, deleted, corrupt) steps. Deletes under the lease, so it never races a live writer.

    Checkpoints are verified newest first until one is intact: that one is the newest (it always
    survives); the newer ones that failed are left alone, never counted as kept or deleted. ``force``: a
    live holder's lease is taken over (fencing it: it can no longer commit or delete) instead of refused;
    the deletes are fenced by the lease taken, like every other delete."""
    if dry_run:
        return _prune_plan(layout, retention)
    lease = layout.lease(DEFAULT_STALE_AFTER_S)  # fences every delete/commit through layout
    lease.forced = force
    try:
        lease.acquire()
    except LeaseError as e:
        why = str(e) if str(e).endswith(".") or force else f"{e}."
        hint = "" if force else " `safepoint prune --force` takes the root over (that job's next save fails)."
        raise LeaseError(f"not pruning: {why}{hint}") from None
    try:
        kept, doomed, corrupt = _prune_plan(layout, retention)  # under the lease: nobody else is adding
        for step in doomed:
            layout.remove(step)
        return kept, doomed, corrupt
    finally:
        lease.release()


def _prune_plan(layout: Layout, retention: Retention) -> tuple[list[int], list[int], list[int]]:
    infos = history(layout)
    corrupt: list[int] = []
    newest: int | None = None
    for info in reversed(infos):
        try:
            require_intact(layout, info.step)
        except CheckpointError:
            corrupt.append(info.step)
            continue
        newest = info.step
        break
    if newest is None:  # nothing verifies: deleting anything could lose the last usable bytes
        return [c.step for c in infos if c.step not in corrupt], [], sorted(corrupt)
    infos = [c for c in infos if c.step not in corrupt]
    doomed = retention.to_delete(infos, protect={newest})
    return [c.step for c in infos if c.step not in doomed], doomed, sorted(corrupt)
