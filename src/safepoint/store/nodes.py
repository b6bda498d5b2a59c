"""Which ranks share a node, and so a node-local tier (``local_root`` on each node's own disk).

A node is named by ``SAFEPOINT_NODE_ID`` if set, else by the host name (``socket.gethostname()``) plus
torchrun's ``GROUP_RANK`` (the agent's node rank in the current rendezvous) when torchrun set it: two
agents on one host (a test, or two containers sharing a host name) are then two nodes, as their
``local_root`` directories may differ. The ranks learn each other's node once, at the manager's start
(one all_gather); the lowest rank of each node is its *leader*, which commits that node's local copy.
"""

from __future__ import annotations

import dataclasses
import os
import socket

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
