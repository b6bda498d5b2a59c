"""Per-node local tiers: ``local_root`` on each node's own disk, the durable tier as the one global commit.

When the ranks of a tiered job span more than one node (store/node_map.py says which ranks share one):

- **Save.** Every rank writes its DCP file into its own node's ``local_root/.pending``; rank 0 commits its
  node's copy (checking only its own node's files) and broadcasts the manifest with the outcome, and each
  other node's leader commits its node's copy under the same manifest (save/saver.py). A node's
  ``step-N`` therefore holds the job's manifest and that node's ranks' files only.
- **Upload.** Each rank says which of the step's files its node holds (one all_gather on the uploader's
  group); each file is uploaded by a rank that holds it (the rank that wrote it if it can), and rank 0
  commits the durable manifest once every file is confirmed. That manifest is the global commit: nothing
  needs rank 0 to see another node's disk. Each other node's leader then keeps a copy of ``.metadata``
  (rank 0 wrote it; a restore on any node needs it) fetched from the durable tier.
- **Restore.** The checkpoint is the newest durable one (or ``step``). Each rank reads each file it needs
  from its node's copy when that copy's entry matches the durable manifest and its crc32c verifies, and
  downloads it from the durable tier otherwise (crc32c checked as it arrives; into ``.pending``, removed
  after the load). ``CheckpointManager.last_restore.files`` says where each file came from.

A checkpoint committed locally but not durable (an upload cut short) counts only once it is uploaded: the
manager's start uploads it when every node still holds its share, and restore waits for those uploads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from safepoint.dist import Comm
from safepoint.errors import CheckpointError
from safepoint.remote.retry import UploadError
from safepoint.restore.restorer import Restorer
from safepoint.state import TrainState
from safepoint.store.manifest import Manifest, Parts
from safepoint.store.node_map import NODES_KEY, NodeMap, file_rank, node_id
from safepoint.store.posix_layout import step_name
from safepoint.store.rootfs import RootDir
from safepoint.store.storage import METADATA_NAME
from safepoint.tiers import peers
from safepoint.tiers.node_view import DURABLE, LOCAL, PEER, NodeView
from safepoint.tiers.tiering import Tiering
from safepoint.tiers.transfer import move_and_commit, with_parts

log = logging.getLogger("safepoint")


class NodeTiering(Tiering):
    """Tiering whose local tier is each node's own: see the module docstring."""

    per_node = True

    def __init__(self, *args: Any, nodes: NodeMap, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nodes = nodes

    @property
    def _prunes(self) -> bool:
        return self.nodes.is_leader

    # ---- start: what the nodes hold ------------------------------------------------------------------

    def start(self) -> None:
        """Collective: each node's leader cleans its own ``.pending``; only a local checkpoint every node
        still holds (same save) is queued for upload, since a node that lost its disk cannot upload its
        share."""
        if self.nodes.is_leader and not self.comm.is_coordinator:
            try:
                self.local.ensure_root()
                for line in self.local.clean_pending():
                    log.info("safepoint: node %s: %s", self.nodes.nodes[self.comm.rank], line)
            except (CheckpointError, OSError) as e:
                log.warning("safepoint: cannot clean up node-local root %s: %s", self.local.root, e)
        held = self.comm.all_gather(self._held() if self.nodes.is_leader else None)
        if self.comm.is_coordinator:
            todo, durable = self._scan
            whole = [s for s in todo if self._whole(s, [h for h in held if h is not None])]
            if whole != todo:
                log.warning(
                    "safepoint: local checkpoint(s) %s are not durable, and the nodes' disks (own copies and "
                    "replicas) no longer hold all of their files: they cannot be uploaded; the job resumes "
                    "from the durable tier", sorted(set(todo) - set(whole)),
                )  # fmt: skip
            self._scan = (whole, durable)
        super().start()

    def _whole(self, step: int, held: list[dict[int, tuple[str, list[str]]]]) -> bool:
        """Whether the nodes together hold every file of rank 0's local ``step``."""
        try:
            manifest = self.local.read_manifest(step)
        except CheckpointError:
            return False
        have = {
            n
            for h in held
            for sid, names in [h.get(step, ("", []))]
            if sid == manifest.save_id
            for n in names
        }
        return set(manifest.files) <= have

    def _held(self) -> dict[int, tuple[str, list[str]]]:
        """step -> (save id, files) of what this node's disk holds of its committed local steps."""
        out = {}
        with contextlib.suppress(OSError, CheckpointError):
            for step in self.local.committed_steps():
                with contextlib.suppress(CheckpointError):
                    manifest = self.local.read_manifest(step)
                    out[step] = (manifest.save_id, sorted(self._sources(manifest)))
        return out

    def _sources(self, manifest: Manifest) -> dict[str, Path]:
        """name -> path of the files of ``manifest``'s save on this node's disk: its own, then its replica."""
        fs, base = self.local.fs, step_name(manifest.step)
        own = {n: fs.full(f"{base}/{n}") for n in manifest.files if fs.isfile(f"{base}/{n}")}
        return {**peers.held(self.local, manifest), **own}

    # ---- upload: each file from a node that holds it -------------------------------------------------

    def _move(self, step: int, pending: str) -> Manifest:
        """Collective on the uploader group: one all_gather of what each rank's node holds, then each file
        is put by one holder, and rank 0 commits the durable manifest (see transfer.move_and_commit)."""
        peers.replicate(self.comm, self.nodes, self.local, step)  # first: a replica is faster to restore
        manifest: Manifest | None = None
        where: dict[str, Path] = {}
        with contextlib.suppress(CheckpointError):
            manifest = self.local.read_manifest(step)
            where = self._sources(manifest)  # a replica uploads the share of a node that is gone
        present = sorted(where)
        listed = sorted(manifest.files) if manifest is not None and self.comm.is_coordinator else []
        held = self.comm.all_gather((manifest.save_id if manifest else None, present, listed))
        mine, missing = _assign(held, self.comm.rank)

        def move() -> dict[str, Parts]:
            if missing and self.comm.is_coordinator:
                raise CheckpointError(f"no node holds {', '.join(missing[:4])} (a node lost its local copy)")
            if not mine:
                return {}
            assert manifest is not None
            files = [(str(where[n]), n, manifest.files[n].size, manifest.files[n].crc32c) for n in mine]
            return self.durable.put_files(pending, files, root=str(self.local.root))

        def commit(parts: list[dict[str, Parts]]) -> None:
            with self._grace.committing() as allowed:
                if not allowed:
                    raise CheckpointError("abandoned at the preemption's grace deadline")
                assert manifest is not None
                # The durable copy holds every file: without the record of node shares, `safepoint
                # verify` there (a local path, or a copy of it) reports a node's lost share as damage.
                extra = {k: v for k, v in manifest.extra.items() if k != NODES_KEY}
                self.durable.commit(pending, with_parts(dataclasses.replace(manifest, extra=extra), parts))

        moved = move_and_commit(self.comm, move, commit, lambda: self.durable.discard(pending))
        if moved.problems or manifest is None:
            raise UploadError(
                f"upload of step {step} to {self.durable.root} failed; nothing was committed there and the "
                f"local copies are kept ({'; '.join(moved.problems) or 'no manifest'})"
            ) from moved.error
        if self.nodes.is_leader and not self.nodes.same_node(0, self.comm.rank):
            self._keep_metadata(step, manifest)
        return manifest

    def _keep_metadata(self, step: int, manifest: Manifest) -> None:
        """A copy of ``.metadata`` in this node's step (rank 0 wrote it on its own node): a restore here
        then reads nothing from the durable tier when the node's own files verify."""
        entry = manifest.files.get(METADATA_NAME)
        fs, target = self.local.fs, f"{step_name(step)}/{METADATA_NAME}"
        if entry is None or fs.lexists(target):
            return
        part = f"{target}.part"
        try:
            # Made through the guarded walk: a symlink planted at the .part (or on the way) is unlinked or
            # refused, never written through.
            fd = fs.create(part)
            try:
                crc = self.durable.store.download(
                    self.durable.object_key(step, METADATA_NAME), fd, entry.size
                )
            finally:
                os.close(fd)
            if crc != entry.crc32c:
                raise CheckpointError(f"crc32c {crc} != {entry.crc32c}")
            fs.move(part, target)
        except (CheckpointError, OSError) as e:
            with contextlib.suppress(OSError):
                fs.remove(part)
            log.warning("safepoint: no local copy of step %d's %s on this node (%s)", step, METADATA_NAME, e)

    # ---- restore -------------------------------------------------------------------------------------

    def restore(self, restorer: Restorer, state: TrainState, step: int | None) -> Manifest | None:
        self.wait()  # the local checkpoints found at the start become durable first: that is the commit
        view = NodeView(self.local, self.durable, self.nodes)
        own = Restorer(view, restorer.comm, restorer.verdicts)
        own.selection = restorer.selection
        with self._no_prune:
            try:
                # On the training thread's group, as any restore (the uploader's is for its thread).
                manifest = own.restore(state, step, lambda below: view.choose(own.comm, step, below))
            finally:
                view.cleanup()
        if own.last_report is not None:
            files = tuple(sorted(view.sources.items()))
            restorer.last_report = dataclasses.replace(own.last_report, files=files)
        if manifest is not None:
            self.observe(manifest.step)
            counts = {s: sum(1 for v in view.sources.values() if v == s) for s in (LOCAL, PEER, DURABLE)}
            log.info(
                "safepoint: rank %d read step %d: %d file(s) from this node's local tier, %d from a peer "
                "node's replica, %d from the durable tier",
                self.comm.rank, manifest.step, counts[LOCAL], counts[PEER], counts[DURABLE],
            )  # fmt: skip
        return manifest


def _assign(held: list[tuple[str | None, list[str], list[str]]], rank: int) -> tuple[list[str], list[str]]:
    """(the files ``rank`` uploads, the files no rank holds) from every rank's (save id, files its node
    holds, and from rank 0 every file of the manifest); rank 0's save is the one uploaded. A file goes to
    the rank that wrote it if that rank holds it, else to the lowest rank that does."""
    want = held[0][0]
    holders: dict[str, list[int]] = {}
    for r, (save_id, names, _) in enumerate(held):
        if save_id is not None and save_id == want:
            for n in names:
                holders.setdefault(n, []).append(r)
    mine, missing = [], []
    for name in held[0][2]:
        ranks = holders.get(name, [])
        if not ranks:
            missing.append(name)
            continue
        writer = file_rank(name) or 0
        if (writer if writer in ranks else ranks[0]) == rank:
            mine.append(name)
    return mine, missing


def build_tiers(comm: Comm, savers: list[Any], *args: Any) -> Tiering:
    """The manager's tiers with a ``local_root`` (``args``: Tiering's, the local layout first): per-node
    ones when the ranks span several nodes, or when a node holds a peer replica (the job ran on several
    nodes and now runs on fewer: the replicas are still of use). One all_gather on ``comm`` at the start."""
    if not comm.distributed:
        return Tiering(*args)
    seen = comm.all_gather((node_id(), RootDir(args[0].root).isdir(peers.PEERS_DIR)))
    nodes = NodeMap(rank=comm.rank, nodes=tuple(n for n, _ in seen))
    if not nodes.multi and not any(has for _, has in seen):
        return Tiering(*args)
    for saver in savers:
        if saver is not None:
            saver.nodes = nodes
    return NodeTiering(*args, nodes=nodes)
