"""Per-node local tiers: ``local_root`` on each node's own disk, the durable tier as the one global commit.

When the ranks of a tiered job span more than one node (store/nodes.py says which ranks share one):

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
import re
from pathlib import Path
from typing import Any

from safepoint.dist import Comm
from safepoint.errors import CheckpointError, CorruptCheckpointError
from safepoint.remote.layout import RemoteLayout
from safepoint.remote.retry import UploadError
from safepoint.restore.restorer import Restorer
from safepoint.state import TrainState
from safepoint.store.checksum import file_crc32c
from safepoint.store.guard import open_regular, remove_tree
from safepoint.store.layout import Layout
from safepoint.store.manifest import Manifest
from safepoint.store.metadata_check import load_checked_metadata
from safepoint.store.nodes import NodeMap, node_id
from safepoint.store.reader import SafeReader
from safepoint.store.storage import METADATA_NAME
from safepoint.tiers import peers
from safepoint.tiers.tiering import Tiering
from safepoint.tiers.transfer import move_and_commit

log = logging.getLogger("safepoint")
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
LOCAL, PEER, DURABLE = "local", "peer", "durable"
"""Where a restored file came from: this node's local tier, another node's replica (tiers/peers.py), or
the durable tier."""


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
            mine = self._held()
            everywhere = [s for s in todo if all(h.get(s) == mine.get(s) for h in held if h is not None)]
            if everywhere != todo:
                log.warning(
                    "safepoint: local checkpoint(s) %s are not held by every node (a node lost its disk or "
                    "is new); they cannot be uploaded and the job resumes from the durable tier",
                    sorted(set(todo) - set(everywhere)),
                )
            self._scan = (everywhere, durable)
        super().start()

    def _held(self) -> dict[int, str]:
        """step -> save id of this node's committed local copies."""
        out = {}
        with contextlib.suppress(OSError, CheckpointError):
            for step in self.local.committed_steps():
                with contextlib.suppress(CheckpointError):
                    out[step] = self.local.read_manifest(step).save_id
        return out

    # ---- upload: each file from a node that holds it -------------------------------------------------

    def _move(self, step: int, pending: str) -> Manifest:
        """Collective on the uploader group: one all_gather of what each rank's node holds, then each file
        is put by one holder, and rank 0 commits the durable manifest (see transfer.move_and_commit)."""
        peers.replicate(self.comm, self.nodes, self.local, step)  # first: a replica is faster to restore
        manifest: Manifest | None = None
        present: list[str] = []
        with contextlib.suppress(CheckpointError):
            manifest = self.local.read_manifest(step)
            base = self.local.step_path(step)
            present = [n for n in sorted(manifest.files) if (base / n).is_file()]
        listed = sorted(manifest.files) if manifest is not None and self.comm.is_coordinator else []
        held = self.comm.all_gather((manifest.save_id if manifest else None, present, listed))
        mine, missing = _assign(held, self.comm.rank)

        def move() -> None:
            if missing and self.comm.is_coordinator:
                raise CheckpointError(f"no node holds {', '.join(missing[:4])} (a node lost its local copy)")
            if mine:
                assert manifest is not None
                base = self.local.step_path(step)
                files = [(str(base / n), n, manifest.files[n].size, manifest.files[n].crc32c) for n in mine]
                self.durable.put_files(pending, files)

        def commit() -> None:
            with self._grace.committing() as allowed:
                if not allowed:
                    raise CheckpointError("abandoned at the preemption's grace deadline")
                assert manifest is not None
                self.durable.commit(pending, manifest)

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
        target = self.local.step_path(step) / METADATA_NAME
        if entry is None or target.exists():
            return
        part = target.with_name(METADATA_NAME + ".part")
        try:
            crc = self.durable.store.download(
                self.durable.object_key(step, METADATA_NAME), str(part), entry.size
            )
            if crc != entry.crc32c:
                raise CheckpointError(f"crc32c {crc} != {entry.crc32c}")
            os.replace(part, target)
        except (CheckpointError, OSError) as e:
            part.unlink(missing_ok=True)
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
        m = _RANK_FILE.match(name)
        writer = int(m.group(1)) if m else 0
        if (writer if writer in ranks else ranks[0]) == rank:
            mine.append(name)
    return mine, missing


class NodeView(Layout):
    """The local tier as a restore reads it: each file from this node's copy when it verifies against the
    durable manifest, else downloaded from the durable tier into ``.pending`` (see the module docstring)."""

    def __init__(self, local: Layout, durable: RemoteLayout, nodes: NodeMap) -> None:
        super().__init__(local.root)
        self.local, self.durable, self.nodes, self.rank = local, durable, nodes, nodes.rank
        self._peer: dict[str, Path] = {}
        self._replica: dict[str, Path] = {}
        self._received: Path | None = None
        self.sources: dict[str, str] = {}
        self._manifest: Manifest | None = None
        self._local: Manifest | None = None
        self._paths: dict[str, str] = {}
        self._scratch: Path | None = None

    def choose(self, comm: Comm, step: int | None, below: int | None) -> Manifest | None:
        """Collective: the newest durable checkpoint (or ``step``) before ``below``, from rank 0's listing."""
        found: tuple[int, bytes] | str | None = None
        if comm.is_coordinator:
            try:
                found = self._newest(step, below)
            except (CheckpointError, OSError) as e:
                found = f"cannot list the durable tier {self.durable.root}: {e}"
        found = comm.broadcast(found)
        if isinstance(found, str):
            raise CheckpointError(found)
        self.cleanup()
        if found is None:
            return None
        manifest = Manifest.from_json(found[1], step_hint=found[0])
        self._use(manifest)
        self._from_peers(comm, manifest)
        return manifest

    def _from_peers(self, comm: Comm, manifest: Manifest) -> None:
        """Collective: the files of this node's share it cannot take from its own disk, from a peer's
        replica when one holds them (tiers/peers.py)."""
        lacking = []
        for name in peers.share(self.nodes, manifest):
            mine = self._local.files.get(name) if self._local is not None else None
            path = self.local.step_path(manifest.step) / name
            if mine != manifest.files[name] or not path.is_file() or path.stat().st_size != mine.size:
                lacking.append(name)
        self._replica = replica = peers.held(self.local, manifest)
        self._received = self.local.pending_root / f"peer-restore-step-{manifest.step}-{manifest.save_id}"
        offer: dict[str, Path] = {}
        if self.nodes.is_leader:  # what this node's disk holds of the save: its own files and its replica
            if self._local is not None:
                base = self.local.step_path(manifest.step)
                own = {n: base / n for n, e in self._local.files.items() if manifest.files.get(n) == e}
                offer = {n: p for n, p in own.items() if p.is_file()}
            offer = {**offer, **replica}
        self._peer = peers.restore_from_peers(comm, self.nodes, manifest, lacking, offer, self._received)

    def _newest(self, step: int | None, below: int | None) -> tuple[int, bytes] | str | None:
        steps = [s for s in self.durable.committed_steps() if below is None or s < below]
        if step is not None and step not in steps:
            return f"no durable checkpoint for step {step} in {self.durable.root} (available: {steps[-10:]})"
        for s in [step] if step is not None else sorted(steps, reverse=True):
            try:
                raw = self.durable.manifest_bytes(s)
                Manifest.from_json(raw, step_hint=s)
                return s, raw
            except (CheckpointError, OSError) as e:
                log.warning(
                    "safepoint: durable checkpoint step %d is unusable (%s); trying an older one", s, e
                )
        return None

    def _use(self, manifest: Manifest) -> None:
        self._manifest, self._local = manifest, None
        self._paths.clear()
        self.sources.clear()
        with contextlib.suppress(CheckpointError, OSError):
            copy = self.local.read_manifest(manifest.step)
            if copy.save_id == manifest.save_id:
                self._local = copy
        self._scratch = (
            self.local.pending_root / f"restore-step-{manifest.step}-{manifest.save_id}-r{self.rank}"
        )

    def cleanup(self) -> None:
        """Remove what this rank downloaded (once loaded, or when another candidate is tried)."""
        if self._scratch is not None:
            remove_tree(self._scratch)
        if self._received is not None and self.nodes.is_leader:
            remove_tree(self._received)
        self._peer = {}

    def paths(self, names: list[str]) -> dict[str, str]:
        """Where each of ``names`` is read from (resolved once per restore; see the class docstring)."""
        for name in names:
            if name not in self._paths:
                self._paths[name], self.sources[name] = self._resolve(name)
        return {n: self._paths[n] for n in names}

    def _resolve(self, name: str) -> tuple[str, str]:
        manifest = self._manifest
        assert manifest is not None and self._scratch is not None
        entry = manifest.files.get(name)
        if entry is None:
            raise CorruptCheckpointError(manifest.step, name, "not listed in the durable manifest")
        if self._local is not None and self._local.files.get(name) == entry:
            path = self.local.step_path(manifest.step) / name
            if path.exists():
                try:
                    self.local.verify(manifest.step, files=[name])
                    return str(path), LOCAL
                except CorruptCheckpointError as e:
                    log.warning(
                        "safepoint: this node's copy is unusable (%s); reading it from the durable tier", e
                    )
        kept = self._replica.get(name)  # a peer's file this node keeps a replica of
        if kept is not None:
            try:
                if file_crc32c(kept) == (entry.size, entry.crc32c):
                    return str(kept), PEER
                log.warning("safepoint: the peer replica of %s does not verify; trying elsewhere", name)
            except OSError as e:
                log.warning("safepoint: cannot read the peer replica of %s (%s)", name, e)
        if name in self._peer:  # sent by a peer: checked when it arrived, and again as it is read
            return str(self._peer[name]), PEER
        self._scratch.mkdir(parents=True, exist_ok=True)
        target = self._scratch / name
        crc = self.durable.store.download(
            self.durable.object_key(manifest.step, name), str(target), entry.size
        )
        if crc != entry.crc32c:
            raise CorruptCheckpointError(
                manifest.step, name, f"crc32c {crc} != {entry.crc32c} (durable copy)"
            )
        return str(target), DURABLE

    def read_metadata(self, step: int, manifest: Manifest) -> Any:
        size = manifest.files[METADATA_NAME].size if METADATA_NAME in manifest.files else 0
        try:
            path = self.paths([METADATA_NAME])[METADATA_NAME]
            with open(open_regular(path), "rb") as f:
                data = f.read(size + 1)
        except OSError as e:
            raise CorruptCheckpointError(step, METADATA_NAME, f"cannot read ({e.strerror or e})") from None
        return load_checked_metadata(step, data, manifest.expected())

    def make_reader(self, step: int, metadata: Any, manifest: Manifest) -> SafeReader:
        reader = super().make_reader(step, metadata, manifest)
        reader.paths = self.paths
        return reader


def build_tiers(comm: Comm, savers: list[Any], *args: Any) -> Tiering:
    """The manager's tiers with a ``local_root`` (``args``: Tiering's, the local layout first): per-node
    ones when the ranks span several nodes, or when a node holds a peer replica (the job ran on several
    nodes and now runs on fewer: the replicas are still of use). One all_gather on ``comm`` at the start."""
    if not comm.distributed:
        return Tiering(*args)
    seen = comm.all_gather((node_id(), (args[0].root / peers.PEERS_DIR).is_dir()))
    nodes = NodeMap(rank=comm.rank, nodes=tuple(n for n, _ in seen))
    if not nodes.multi and not any(has for _, has in seen):
        return Tiering(*args)
    for saver in savers:
        if saver is not None:
            saver.nodes = nodes
    return NodeTiering(*args, nodes=nodes)
