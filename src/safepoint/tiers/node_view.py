"""The local tier as a restore on one node of a multi-node job reads it (tiers/node_tiers.py): each file from
this node's copy when it verifies against the durable manifest, else from a peer's replica (kept on this
disk, or sent by the node that holds it: tiers/peers.py), else downloaded from the durable tier."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path
from typing import Any

from safepoint.dist import Comm
from safepoint.errors import CheckpointError, CorruptCheckpointError
from safepoint.remote.object_layout import RemoteLayout
from safepoint.store.guard import read_up_to
from safepoint.store.manifest import Manifest
from safepoint.store.metadata_check import load_checked_metadata
from safepoint.store.node_map import NodeMap
from safepoint.store.posix_layout import PENDING_DIR, Layout, step_name
from safepoint.store.reader import SafeReader
from safepoint.store.storage import METADATA_NAME
from safepoint.tiers import peers

log = logging.getLogger("safepoint")
LOCAL, PEER, DURABLE = "local", "peer", "durable"
"""Where a restored file came from: this node's local tier, another node's replica (tiers/peers.py), or
the durable tier."""


class NodeView(Layout):
    """The local tier as a restore reads it: each file from this node's copy when it verifies against the
    durable manifest, else downloaded from the durable tier into ``.pending`` (see the module docstring)."""

    def __init__(self, local: Layout, durable: RemoteLayout, nodes: NodeMap) -> None:
        super().__init__(local.root)
        self.local, self.durable, self.nodes, self.rank = local, durable, nodes, nodes.rank
        self._peer: dict[str, Path] = {}
        self._replica: dict[str, Path] = {}
        self._received: str | None = None  # names under the local root (store/rootfs.py)
        self.sources: dict[str, str] = {}
        self._manifest: Manifest | None = None
        self._local: Manifest | None = None
        self._paths: dict[str, str] = {}
        self._scratch: str | None = None  # self.fs (Layout's): this node's disk, through the guarded walk

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
        fs, base = self.fs, step_name(manifest.step)
        for name in peers.share(self.nodes, manifest):
            mine = self._local.files.get(name) if self._local is not None else None
            st = fs.lstat(f"{base}/{name}")  # None through a symlink on the way; a FIFO is not "a file"
            if (
                mine != manifest.files[name]
                or st is None
                or not stat.S_ISREG(st.st_mode)
                or st.st_size != mine.size
            ):
                lacking.append(name)
        self._replica = replica = peers.held(self.local, manifest)
        self._received = f"{PENDING_DIR}/peer-restore-step-{manifest.step}-{manifest.save_id}"
        offer: dict[str, Path] = {}
        if self.nodes.is_leader:  # what this node's disk holds of the save: its own files and its replica
            if self._local is not None:
                own = [n for n, e in self._local.files.items() if manifest.files.get(n) == e]
                offer = {n: fs.full(f"{base}/{n}") for n in own if fs.isfile(f"{base}/{n}")}
            offer = {**offer, **replica}
        self._peer = peers.restore_from_peers(comm, self.nodes, manifest, lacking, offer, fs, self._received)

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
        self._scratch = f"{PENDING_DIR}/restore-step-{manifest.step}-{manifest.save_id}-r{self.rank}"

    def cleanup(self) -> None:
        """Remove what this rank downloaded (once loaded, or when another candidate is tried)."""
        # Through the guarded walk: under a symlinked .pending these name nothing of ours, and nothing
        # outside the root (a directory there with the same name) is removed.
        if self._scratch is not None:
            self.fs.remove_tree(self._scratch)
        if self._received is not None and self.nodes.is_leader:
            self.fs.remove_tree(self._received)
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
            if self.fs.lexists(f"{step_name(manifest.step)}/{name}"):
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
                if self.fs.crc32c(kept) == (entry.size, entry.crc32c):  # no symlink, no FIFO
                    return str(kept), PEER
                log.warning("safepoint: the peer replica of %s does not verify; trying elsewhere", name)
            except OSError as e:
                log.warning("safepoint: cannot read the peer replica of %s (%s)", name, e)
        if name in self._peer:  # sent by a peer: checked when it arrived, and again as it is read
            return str(self._peer[name]), PEER
        target = f"{self._scratch}/{name}"
        fd = self.fs.create(target, parents=True)  # a symlinked .pending is refused, never written through
        try:
            crc = self.durable.store.download(self.durable.object_key(manifest.step, name), fd, entry.size)
        finally:
            os.close(fd)
        if crc != entry.crc32c:
            raise CorruptCheckpointError(
                manifest.step, name, f"crc32c {crc} != {entry.crc32c} (durable copy)"
            )
        return str(self.fs.full(target)), DURABLE

    def read_metadata(self, step: int, manifest: Manifest) -> Any:
        size = manifest.files[METADATA_NAME].size if METADATA_NAME in manifest.files else 0
        try:
            path = self.paths([METADATA_NAME])[METADATA_NAME]
            with os.fdopen(self.fs.open_read(Path(path)), "rb") as f:
                data = read_up_to(f, size + 1)  # chunked: a forged size is never allocated
        except OSError as e:
            raise CorruptCheckpointError(step, METADATA_NAME, f"cannot read ({e.strerror or e})") from None
        return load_checked_metadata(step, data, manifest.expected())

    def make_reader(self, step: int, metadata: Any, manifest: Manifest) -> SafeReader:
        reader = super().make_reader(step, metadata, manifest)
        reader.paths = self.paths
        return reader
