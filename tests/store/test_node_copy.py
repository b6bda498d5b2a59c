"""`safepoint verify` on one node's ``local_root`` (per-node local tiers, issue 15): a node's copy holds its
own ranks' files only, and the manifest records which ranks each node held (``extra["nodes"]``). What is
missing must be exactly other nodes' whole shares to be reported as a node copy; anything else stays damage.
The multi-node run itself is in tests/dist/test_nodes.py (which also runs the CLI on each node's root)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from safepoint.store.node_map import NODES_KEY, NodeMap, node_copy

FILES = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
FILES += [f"rank-{r}.state" for r in range(4)]
TWO_NODES = {NODES_KEY: NodeMap(rank=0, nodes=("A", "A", "B", "B")).ranges()}


def of(ranks: list[int]) -> set[str]:
    return {n for n in FILES if any(n in (f"__{r}_0.distcp", f"rank-{r}.state") for r in ranks)}


def test_ranges_are_runs_of_ranks() -> None:
    nodes = NodeMap(rank=0, nodes=("a", "a", "b", "a", "c", "c"))
    assert nodes.ranges() == {"a": [[0, 1], [3, 3]], "b": [[2, 2]], "c": [[4, 5]]}


def test_a_node_copy_is_its_own_ranks_files() -> None:
    assert node_copy(TWO_NODES, 4, FILES, of([2, 3])) == ["A"]
    assert node_copy(TWO_NODES, 4, FILES, of([0, 1])) == ["B"]


@pytest.mark.parametrize(
    "absent",
    [
        set(),  # nothing missing: a whole checkpoint, not a node copy
        of([3]),  # node B lost one rank's files: damage
        {"__2_0.distcp"},  # one file of a rank
        of([2, 3]) | {".metadata"},  # .metadata is every node's
        of([0, 1, 2, 3]),  # no node's share at all
    ],
)
def test_anything_but_whole_shares_missing_is_damage(absent: set[str]) -> None:
    assert node_copy(TWO_NODES, 4, FILES, absent) is None


@pytest.mark.parametrize(
    "extra",
    [
        {},  # a single-node save, or an older manifest
        {NODES_KEY: [["A", 0, 1]]},
        {NODES_KEY: {"A": [[0, 1]], "B": [[1, 3]]}},  # rank 1 on two nodes
        {NODES_KEY: {"A": [[0, 1]], "B": [[2, 4]]}},  # past the world size
        {NODES_KEY: {"A": [[0, 1]], "B": [[3, 2]]}},
        {NODES_KEY: {"A": [[0, 1.0]], "B": [[2, 3]]}},
        {NODES_KEY: {"A": [[0, True]], "B": [[2, 3]]}},
        {NODES_KEY: {"A": [[0, 1]]}},  # ranks 2 and 3 on no node
        {NODES_KEY: {"A": "0-1", "B": [[2, 3]]}},
    ],
)
def test_a_malformed_or_absent_node_record_means_damage(extra: dict[str, Any]) -> None:
    assert node_copy(extra, 4, FILES, of([2, 3])) is None


def test_a_huge_claimed_world_costs_no_more_than_the_manifest() -> None:
    # A hostile manifest claiming a billion ranks on one node: binary search over the runs, no loop over
    # ranks (a loop would take minutes here).
    extra = {NODES_KEY: {"A": [[0, 1]], "B": [[2, 10**9 - 1]]}}
    t0 = time.process_time()
    assert node_copy(extra, 10**9, FILES, of([2, 3])) == ["A"]
    assert time.process_time() - t0 < 5  # a bound on work, far above the microseconds it takes
