"""Moving checkpoints between the tiers: uploads (local -> durable) and restores (durable -> local).

Both are collectives on a group of their own: every rank moves its share of the files, then rank 0
commits on the receiving tier only if every rank succeeded, else discards what was moved (one rule, in
:func:`move_and_commit`). Uploads: each rank its own files (``__<rank>_<n>.distcp``; rank 0 the rest).

Restore takes the newest intact checkpoint of the local tier or the durable one. The local copy is used if
it verifies. Otherwise, or if the durable tier has a newer one (the node was replaced), the durable
checkpoint is downloaded into the local tier first (ranged GETs in parallel, crc32c checked as the bytes
arrive, committed with the local protocol), then loaded from local disk: one transfer, where reading the
store directly would move every byte twice (once to verify, once to load).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from safepoint.dist import Comm
from safepoint.errors import CheckpointError, CorruptCheckpointError, warn_caller
from safepoint.events import RESTORE_FALLBACK
from safepoint.remote.object_layout import RemoteLayout
from safepoint.remote.retry import UploadError
from safepoint.restore.restorer import CheckpointWarning, Restorer
from safepoint.store.incremental import is_stable_group
from safepoint.store.manifest import Manifest, Parts
from safepoint.store.posix_layout import Layout

log = logging.getLogger("safepoint")
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


@dataclasses.dataclass(frozen=True, slots=True)
class Moved:
    """What :func:`move_and_commit` found: ``problems`` and ``unexpected`` are the same on every rank;
    ``error`` is this rank's own exception (to chain from), if it had one."""

    problems: list[str]
    unexpected: bool = False
    """Some rank failed with something other than a CheckpointError or OSError (a bug, most likely)."""
    error: BaseException | None = None


def _expected(e: BaseException) -> bool:
    return isinstance(e, (CheckpointError, OSError))


def move_and_commit(
    comm: Comm,
    move: Callable[[], object],
    commit: Callable[[list[Any]], object],
    discard: Callable[[], object],
) -> Moved:
    """Collective: every rank runs ``move`` (its share); if all succeeded rank 0 runs ``commit`` with what
    each rank's ``move`` returned (in rank order), and if anything failed (a commit too) rank 0 runs
    ``discard``. Any exception is recorded, never raised from here: every rank always reaches both
    collectives, so none is left waiting for one that failed. The caller raises (the same decision on every
    rank, from the returned problems)."""
    problem: tuple[str, bool] | None = None
    error: BaseException | None = None
    result: Any = None
    try:
        result = move()
    except Exception as e:
        error, problem = e, (f"rank {comm.rank}: {e if _expected(e) else repr(e)}", not _expected(e))
    everyone = comm.all_gather((problem, result))
    gathered = [p for p, _ in everyone if p]
    problems, unexpected = [p for p, _ in gathered], any(u for _, u in gathered)
    if comm.is_coordinator:
        if not problems:
            try:
                commit([r for _, r in everyone])
            except Exception as e:
                error = error or e
                problems.append(f"commit: {e if _expected(e) else repr(e)}")
                unexpected = unexpected or not _expected(e)
        if problems:
            try:
                discard()
            except Exception as e:  # the problems are reported anyway; what is left is cleaned up later
                log.warning("safepoint: could not discard the failed transfer: %r", e)
    problems, unexpected = comm.broadcast((problems, unexpected))
    return Moved(problems, unexpected, error)


def upload_checkpoint(
    comm: Comm,
    local: Layout,
    durable: RemoteLayout,
    step: int,
    pending: str,
    committing: Callable[[], contextlib.AbstractContextManager[bool]] | None = None,
) -> Manifest:
    """Collective: upload local ``step`` into the durable tier's ``pending`` and commit it there (manifest
    last). Rank 0 commits inside ``committing()``, which yields whether the commit may start (False:
    discard instead). Raises UploadError on every rank if anything failed on any rank (chained from this
    rank's own exception); nothing is then committed on the durable tier."""
    manifest: Manifest | None = None

    def move() -> dict[str, Parts]:
        nonlocal manifest
        manifest = local.read_manifest(step)
        base = local.step_path(step)
        mine = [n for n in sorted(manifest.files) if _owner(n, comm.world_size) == comm.rank]
        files = manifest.files
        # Incremental saves: a stable group the durable tier already holds (same name, size and crc32c in
        # its newest step below this one) is copied there server-side, no byte sent (store/incremental.py).
        before = _durable_before(durable, step) if any(map(is_stable_group, mine)) else None
        same = [
            n
            for n in mine
            if before is not None
            and is_stable_group(n)
            and n in before[1].files
            and (before[1].files[n].size, before[1].files[n].crc32c) == (files[n].size, files[n].crc32c)
        ]
        if before is not None and same:
            # A copy that could not be proven (a source altered in place, say) is uploaded from here.
            failed = durable.copy_files(
                before[0], pending, [(n, files[n].size, files[n].crc32c) for n in same]
            )
            same = [n for n in same if n not in failed]
        rest = [n for n in mine if n not in same]
        todo = [(str(base / n), n, files[n].size, files[n].crc32c) for n in rest]
        return durable.put_files(pending, todo, root=str(local.root))

    def commit(parts: list[dict[str, Parts]]) -> None:
        with committing() if committing is not None else contextlib.nullcontext(True) as allowed:
            if not allowed:
                raise CheckpointError("abandoned at the preemption's grace deadline")
            assert manifest is not None
            # Each rank confirmed its own objects; the manifest records how they went up (their parts).
            durable.commit(pending, with_parts(manifest, parts), confirmed=True)

    moved = move_and_commit(comm, move, commit, lambda: durable.discard(pending))
    if moved.problems or manifest is None:
        raise UploadError(
            f"upload of step {step} to {durable.root} failed; nothing was committed there and the "
            f"local copy is kept ({'; '.join(moved.problems) or 'no manifest'})"
        ) from moved.error
    return manifest


def with_parts(manifest: Manifest, parts: Sequence[dict[str, Parts] | None]) -> Manifest:
    """``manifest`` recording the parts every rank's uploads went up in (``RemoteLayout.put_files``)."""
    merged = {name: p for rank in parts for name, p in (rank or {}).items()}
    return manifest.with_parts(merged)


def _durable_before(durable: RemoteLayout, step: int) -> tuple[int, Manifest] | None:
    """The durable tier's newest committed step below ``step``, with its manifest (None: none readable)."""
    older = [s for s in durable.committed_steps() if s < step]
    if not older:
        return None
    try:
        return older[-1], durable.read_manifest(older[-1])
    except CheckpointError:
        return None


def _owner(name: str, world_size: int) -> int:
    m = _RANK_FILE.match(name)
    return int(m.group(1)) % world_size if m else 0


def choose_across_tiers(
    restorer: Restorer,
    local: Layout,
    durable: RemoteLayout,
    step: int | None,
    fetched: Callable[[Manifest], None],
    below: int | None = None,
) -> Manifest | None:
    """Collective: the manifest to load (``step``, or the newest intact one), downloaded if need be;
    ``fetched`` is told of each durable checkpoint brought into the local tier."""
    comm = restorer.comm
    chosen: Manifest | None = None
    missing: CheckpointError | None = None
    try:
        chosen = restorer.choose(step, below)
    except CheckpointError as e:
        if step is None:
            raise
        missing = e
    steps = comm.broadcast(durable.committed_steps() if comm.is_coordinator else [])
    if step is not None:
        candidates = [step] if chosen is None and step in steps else []
    else:
        candidates = [
            s for s in reversed(steps) if (chosen is None or s > chosen.step) and (below is None or s < below)
        ]
    for s in candidates:
        got = fetch_durable(comm, local, durable, s)
        if isinstance(got, Manifest):
            fetched(got)
            return restorer.choose(s)
        restorer.events.emit(RESTORE_FALLBACK, s, tier="durable", reason=f"unusable: {got}")
        if comm.is_coordinator:
            msg = f"safepoint: durable checkpoint step {s} is unusable ({got}); trying an older one"
            warn_caller(msg, CheckpointWarning)  # at the user's restore() line
            log.warning(msg)
    if missing is not None:
        raise missing
    return chosen


def fetch_durable(comm: Comm, local: Layout, durable: RemoteLayout, step: int) -> Manifest | str:
    """Download a durable checkpoint into the local tier: its manifest if it worked, else what went wrong.

    Collective: every rank downloads a share of the files (into the shared local root, like a save),
    checking each file's crc32c as its bytes arrive; rank 0 commits it locally once all are in.
    """
    plan: tuple[bytes, str] | str = ""
    if comm.is_coordinator:
        try:
            raw = durable.manifest_bytes(step)
            manifest = Manifest.from_json(raw, step_hint=step)
            pending = local.new_pending(step, manifest.save_id)
            local.fs.makedirs(pending)  # through the guarded walk: a symlinked .pending is refused
            plan = (raw, str(pending))
        except (CheckpointError, OSError) as e:
            plan = str(e)
    plan = comm.broadcast(plan)
    if isinstance(plan, str):
        return plan
    manifest, pending = Manifest.from_json(plan[0], step_hint=step), Path(plan[1])

    def get(name: str) -> None:
        entry = manifest.files[name]
        key = durable.object_key(step, name)
        fd = local.fs.create(pending / name)  # a planted symlink is unlinked, never written through
        try:
            crc = durable.store.download(key, fd, entry.size)
        finally:
            os.close(fd)
        if crc != entry.crc32c:
            raise CorruptCheckpointError(step, name, f"crc32c {crc} != {entry.crc32c} (contents altered)")

    t0 = time.perf_counter()
    moved = move_and_commit(
        comm,
        lambda: durable.store._parallel(get, sorted(manifest.files)[comm.rank :: comm.world_size]),
        lambda _: local.commit(pending, manifest),
        lambda: local.discard(pending),
    )
    if moved.unexpected:  # not a bad checkpoint: a failure to report, on every rank alike
        raise CheckpointError(
            f"downloading durable step {step} failed: {'; '.join(moved.problems)}"
        ) from moved.error
    if moved.problems:
        return moved.problems[0]
    log.info(
        "safepoint: downloaded durable step %d (%.1f MB in %.2fs)",
        step,
        manifest.total_bytes / 1e6,
        time.perf_counter() - t0,
    )
    return manifest
