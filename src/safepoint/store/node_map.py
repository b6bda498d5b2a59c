"""Which ranks share a node, and so a node-local tier (``local_root`` on each node's own disk).

A node is named by ``SAFEPOINT_NODE_ID`` if set, else by the host name (``socket.gethostname()``) plus
torchrun's ``GROUP_RANK`` (the agent's node rank in the current rendezvous) when torchrun set it: two
agents on one host (a test, or two containers sharing a host name) are then two nodes, as their
``local_root`` directories may differ. The ranks learn each other's node once, at the manager's start
(one all_gather); the lowest rank of each node is its *leader*, which commits that node's local copy.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import os
import re
import socket
from collections.abc import Iterable
from typing import Any

NODE_ENV = "SAFEPOINT_NODE_ID"


def node_id() -> str:
    """This process's node, as described in the module docstring."""
    explicit = os.environ.get(NODE_ENV, "").strip()
    if explicit:
        return explicit
    host = socket.gethostname()
    group = os.environ.get("GROUP_RANK")
    return f"{host}/{group}" if group is not None and group.strip() else host


@dataclasses.dataclass(frozen=True, slots=True)
class NodeMap:
    """The node of every rank of the job (same on every rank)."""

    rank: int
    """This process's rank."""
    nodes: tuple[str, ...]
    """``nodes[r]``: the node rank ``r`` runs on."""

    @property
    def count(self) -> int:
        """How many nodes the job spans."""
        return len(set(self.nodes))

    @property
    def multi(self) -> bool:
        """More than one node: each node commits its own local copy."""
        return self.count > 1

    def leader(self, rank: int | None = None) -> int:
        """The lowest rank on ``rank``'s node (this rank's node by default)."""
        node = self.nodes[self.rank if rank is None else rank]
        return self.nodes.index(node)

    @property
    def is_leader(self) -> bool:
        return self.leader() == self.rank

    def same_node(self, a: int, b: int) -> bool:
        return self.nodes[a] == self.nodes[b]

    def index(self, rank: int | None = None) -> int:
        """The node's position among the job's nodes, ordered by their leaders' ranks."""
        leaders = sorted({self.leader(r) for r in range(len(self.nodes))})
        return leaders.index(self.leader(rank))

    def ranges(self) -> dict[str, list[list[int]]]:
        """``{node: [[first, last], ...]}``: each node's ranks as inclusive runs, recorded in the manifest
        (``extra[NODES_KEY]``) so a node's copy can be told from a damaged checkpoint (``node_copy``). Runs
        keep it small: a few bytes per node, not per rank."""
        out: dict[str, list[list[int]]] = {}
        for rank, node in enumerate(self.nodes):
            runs = out.setdefault(node, [])
            if runs and runs[-1][1] == rank - 1:
                runs[-1][1] = rank
            else:
                runs.append([rank, rank])
        return out


# A file one rank wrote: its DCP shards (``__<rank>_<n>.distcp``), its per-rank sections
# (``rank-<rank>.state``, store/rank_state.py) and its incremental record (``rank-<rank>.fingerprints``,
# store/incremental_record.py).
RANK_FILE = re.compile(r"^(?:__(\d+)_\d+\.distcp|rank-(\d+)\.(?:state|fingerprints))$")
NODES_KEY = "nodes"
"""``Manifest.extra[NODES_KEY]``: NodeMap.ranges() of the save, set when the job spanned several nodes."""


def file_rank(name: str) -> int | None:
    """The rank that wrote ``name``, for a rank file; None for any other file (``.metadata``)."""
    m = RANK_FILE.match(name)
    return int(m.group(1) or m.group(2)) if m else None


def node_copy(
    extra: dict[str, Any], world_size: int, files: Iterable[str], absent: set[str]
) -> list[str] | None:
    """The nodes whose whole share is present, when ``absent`` (files of the checkpoint not in this
    directory) is exactly the other nodes' whole shares: a node-local tier's copy (tiers/node_tiers.py), which
    holds its own ranks' files only. None otherwise, including a manifest without a well-formed
    ``extra[NODES_KEY]`` (a hostile or older one): then a missing file is damage, as for any checkpoint."""
    raw = extra.get(NODES_KEY)
    if not isinstance(raw, dict) or not absent:
        return None
    runs: list[tuple[int, int, str]] = []
    for node, spans in raw.items():
        if not isinstance(node, str) or not isinstance(spans, list):
            return None
        for span in spans:
            if not (isinstance(span, list) and len(span) == 2 and all(type(r) is int for r in span)):
                return None
            if not 0 <= span[0] <= span[1] < world_size:
                return None
            runs.append((span[0], span[1], node))
    # Sorted, non-overlapping runs and a binary search per file: the work stays in the manifest's size
    # whatever a hostile manifest claims for world_size.
    runs.sort()
    if any(a[1] >= b[0] for a, b in itertools.pairwise(runs)):
        return None  # a rank on two nodes: not what a save records
    starts = [r[0] for r in runs]

    def owner(rank: int) -> str | None:
        i = bisect.bisect_right(starts, rank) - 1
        return runs[i][2] if i >= 0 and runs[i][1] >= rank else None

    here: set[str] = set()
    gone: set[str] = set()
    for name in files:
        rank = file_rank(name)
        if rank is None:
            if name in absent:
                return None  # .metadata (every node keeps a copy) is missing: not a usable node copy
            continue
        node = owner(rank)
        if node is None:
            return None
        (gone if name in absent else here).add(node)
    if not here or here & gone:
        return None  # nothing of any node, or a node with some of its files gone: damage
    return sorted(here)
