"""Peer replicas (issue 15, item 3): each node's share of a checkpoint also sits on another node's disk.

With per-node local tiers (tiers/node_tiers.py), after a step is committed locally the uploader thread (in the
background, on the uploader's gloo group, in lock-step like the uploads) sends each node's files to the
next node in a ring of node leaders: node ``k`` -> node ``(k + 1) % nodes``, so a replica is always on
another *node*, for any node count (torch's ``_ReplicationStager`` pairs rank r with r + world/2, which
needs an even world and can land on the same node). The bytes move with ``torch.distributed``
(``isend``/``irecv`` of uint8 tensors on the job's group: gloo here, NCCL on GPUs would be the same
calls). The receiver checks each file's crc32c against the sender's manifest entry and commits the replica
as ``local_root/.peers/step-N/`` (files + ``replica.json``: step, save id, sizes and crc32c), replacing
the previous one: one replica per node, of the newest step.

Restore (collective, before DCP loads): each node's leader says which files of its node's share (the
``.metadata`` and its ranks' ``__<rank>_*.distcp``) it cannot take from its own disk, and which replica
files it holds; each missing file a peer holds is sent to it the same way, checked against the durable
manifest's crc32c, and read from there ("peer" in ``RestoreReport.files``). What no peer holds comes from
the durable tier.

Files move in chunks, all pairs at once, one chunk per pair in memory, written to disk as they arrive
(tiers/peer_stream.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import stat
from pathlib import Path

from safepoint.dist import Comm
from safepoint.errors import CheckpointError
from safepoint.store.manifest import Manifest
from safepoint.store.node_map import NodeMap, file_rank
from safepoint.store.posix_layout import PENDING_DIR, Layout
from safepoint.store.records import CorruptRecordError, dict_field, parse_object, str_field
from safepoint.store.rootfs import RootDir
from safepoint.store.storage import METADATA_NAME
from safepoint.tiers.peer_stream import Entry, exchange

log = logging.getLogger("safepoint")
PEERS_DIR = ".peers"
REPLICA_NAME = "replica.json"
# A replica record lists each file in ~60 bytes: 16 MiB is far beyond any real one (and bounds the read).
MAX_RECORD_BYTES = 16 << 20


def _leaders(nodes: NodeMap) -> list[int]:
    return sorted({nodes.leader(r) for r in range(len(nodes.nodes))})


def replicate(comm: Comm, nodes: NodeMap, local: Layout, step: int) -> None:
    """Collective (uploader group): node k's leader sends its node's files of ``step`` to node k+1's."""
    offer: tuple[str, list[Entry]] | None = None
    fs, base = local.fs, f"step-{step}"
    if nodes.is_leader:
        with contextlib.suppress(CheckpointError, OSError):
            m = local.read_manifest(step)
            offer = (
                m.save_id,
                # Only files whose size on disk is their entry's: a forged entry never makes this node
                # stream (and its peer store) more bytes than the file has.
                [
                    (n, e.size, e.crc32c)
                    for n, e in sorted(m.files.items())
                    if _sized(fs, f"{base}/{n}", e.size)
                ],
            )
    offers = comm.all_gather(offer)
    leaders = _leaders(nodes)
    plan: list[tuple[int, int, Entry]] = []
    for i, src in enumerate(leaders):
        dst = leaders[(i + 1) % len(leaders)]
        got = offers[src]
        if got is not None and dst != src:
            plan.extend((src, dst, entry) for entry in got[1])
    # This leader's replica arrives straight into .pending (chunk by chunk: see peer_stream) and is
    # renamed into .peers once every file checked.
    i = leaders.index(nodes.leader())
    src = leaders[(i - 1) % len(leaders)]
    sent = offers[src] if nodes.is_leader and src != comm.rank else None
    # Everything below goes through the guarded walk (store/rootfs.py): a symlinked .pending or .peers is
    # refused, never followed, so neither the replica's files nor its deletes can reach outside the root.
    pending = f"{PENDING_DIR}/replica-step-{step}-{sent[0] if sent else ''}"
    if sent is not None:
        fs.remove_tree(pending)
    data = exchange(comm, plan, fs, {n: f"{base}/{n}" for _, _, (n, _, _) in plan}, pending)
    if sent is None:
        return
    if len(data) != len(sent[1]):
        log.warning("safepoint: replica of step %d from rank %d incomplete; not keeping it", step, src)
        fs.remove_tree(pending)
        return
    try:
        _commit_replica(fs, step, sent[0], sent[1], pending)
    except OSError as e:
        log.warning("safepoint: cannot keep the peer replica of step %d: %s", step, e)
        fs.remove_tree(pending)


def _sized(fs: RootDir, name: str, size: int) -> bool:
    st = fs.lstat(name)
    return st is not None and stat.S_ISREG(st.st_mode) and st.st_size == size


def _commit_replica(fs: RootDir, step: int, save_id: str, entries: list[Entry], pending: str) -> None:
    """``pending`` holds every file of the replica (checked): add its record and make it the replica."""
    record = {"step": step, "save_id": save_id, "files": {n: [s, c] for n, s, c in entries}}
    fs.write(f"{pending}/{REPLICA_NAME}", json.dumps(record).encode())
    if (odd := fs.kind(PEERS_DIR)) not in (None, "a directory"):
        raise OSError(f"{fs.full(PEERS_DIR)} is {odd}, not a directory; left alone (remove it)")
    fs.makedirs(PEERS_DIR, parents=False)
    target = f"{PEERS_DIR}/step-{step}"
    fs.remove_tree(target)
    fs.move(pending, target)
    for old in fs.listdir(PEERS_DIR):  # one replica per node: the newest step's
        if old != f"step-{step}":
            fs.remove_tree(f"{PEERS_DIR}/{old}")


def held(local: Layout, manifest: Manifest) -> dict[str, Path]:
    """The files of this node's replica that belong to ``manifest``'s save (entries equal to its own):
    regular files reached without a symlink. A record that is not a bounded regular file (a FIFO, a
    symlink, a huge file) or does not parse means "corrupt: not used", said in one line."""
    fs, base = local.fs, f"{PEERS_DIR}/step-{manifest.step}"
    if not fs.lexists(base):
        return {}
    try:
        record = parse_object(fs.read(f"{base}/{REPLICA_NAME}", MAX_RECORD_BYTES), REPLICA_NAME)
        if str_field(record, "save_id", REPLICA_NAME, max_len=64) != manifest.save_id:
            return {}
        files = dict_field(record, "files", REPLICA_NAME)
    except FileNotFoundError:
        return {}
    except (OSError, CorruptRecordError) as e:
        # A damaged replica is no replica: the files come from the node's own disk or the durable tier.
        log.warning("safepoint: peer replica %s is corrupt, not used (%s)", fs.full(base), e)
        return {}
    out = {}
    for name, entry in files.items():
        mine = manifest.files.get(name)
        if mine is not None and [mine.size, mine.crc32c] == entry and fs.isfile(f"{base}/{name}"):
            out[name] = fs.full(f"{base}/{name}")
    return out


def share(nodes: NodeMap, manifest: Manifest) -> list[str]:
    """This node's share of ``manifest``: ``.metadata`` and the files its ranks wrote (by rank number)."""
    mine = {r for r in range(len(nodes.nodes)) if nodes.same_node(r, nodes.rank)}
    out = []
    for name in sorted(manifest.files):
        if name == METADATA_NAME or file_rank(name) in mine:
            out.append(name)
    return out


def restore_from_peers(
    comm: Comm,
    nodes: NodeMap,
    manifest: Manifest,
    lacking: list[str],
    replica: dict[str, Path],
    fs: RootDir,
    into: str,
) -> dict[str, Path]:
    """Collective (before the load): every leader names the files of its share it ``lacking`` and those
    its ``replica`` holds; each lacking file some other node holds is sent to the leader, checked and
    written under ``into`` (a name under ``fs``: this node's disk, read by every rank of the node after
    the final barrier).
    Returns name -> path of the files received by this node (on every rank of it)."""
    mine = (lacking, sorted(replica)) if nodes.is_leader else ([], [])
    wants = comm.all_gather(mine)
    plan: list[tuple[int, int, Entry]] = []
    for dst, (lack, _) in enumerate(wants):
        for name in lack:
            src = next((r for r, (_, have) in enumerate(wants) if r != dst and name in have), None)
            if src is not None:
                e = manifest.files[name]
                plan.append((src, dst, (name, e.size, e.crc32c)))
    exchange(comm, plan, fs, replica, into)  # each file checked, written as <name>.part, then renamed
    comm.barrier("peer restore")  # the leader's files are written before any rank of its node reads them
    leader = nodes.leader()
    got = [name for _, d, (name, _, _) in plan if d == leader and fs.isfile(f"{into}/{name}")]
    return {name: fs.full(f"{into}/{name}") for name in got}
