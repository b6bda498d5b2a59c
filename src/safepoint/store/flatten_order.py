"""The order in which safepoint's DCP planners flatten a state: the state first, then its ShardedTensors.

DCP's save planner flattens in that order and its load planner the other way round. Flattening
ShardedTensors first rebuilds the state from its leaves, which drops an empty dict or list from a list DCP
walks item by item (``{"a": [0, {}]}``): the load then asks for ``a`` where the save wrote ``a.0``, and a
committed checkpoint cannot be restored (torch 2.13's ``dcp.load`` fails on it;
tests/restore/test_empty_container_in_list.py). So the save planner (save/plan_reuse.py) and the load
planner (store/reader.py) both set up through ``set_up_sharded_last``.

On a flattened state without a ShardedTensor, the second walk gives an equal dict (the same keys in the
same order: every value is a leaf), so it runs only where there is one (~0.1 ms of a small state's save,
issue 27).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors


def set_up_sharded_last(planner: Any, set_up: Callable[[], None]) -> None:
    """Run DCP's ``set_up`` of ``planner`` (its ``set_up_planner``) with the flattening of ShardedTensors
    held back, then flatten them in the flattened state, where the planner asks for it and there is one."""
    sharded, planner.flatten_sharded_tensors = planner.flatten_sharded_tensors, False
    try:
        set_up()
    finally:
        planner.flatten_sharded_tensors = sharded
    if sharded and (
        not planner.flatten_state_dict
        or any(isinstance(v, ShardedTensor) for v in planner.state_dict.values())
    ):
        planner.state_dict = _flatten_sharded_tensors(planner.state_dict)
