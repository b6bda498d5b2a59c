"""The allocation side of async staging (save/staging.py): a new buffer set's private copies and its ties.

Run once per buffer set, when ``Stager`` allocates, never per save."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor

from safepoint.save.kinds import SCALARS, alias, plain
from safepoint.save.pickled import terminal
from safepoint.save.stage_plan import walk

Alias = tuple[Any, ...]


def staged_form(sd: Any) -> Any:
    """What the buffers are allocated for: ``sd`` with each value DCP pickles whole (save/pickled.py) in
    place as the tuple of what its walk copies, in walk order (the bytes of each storage in it, its DTensors
    and other tensors): the walk of the buffers then meets their leaves in the order of the state's walk.
    ``sd`` itself where it holds no such value."""
    if isinstance(sd, dict):
        new = {k: staged_form(v) for k, v in sd.items()}
        return sd if all(new[k] is v for k, v in sd.items()) else new
    # As the walk decides: a list with more than numbers and strings in it is asked whether it is terminal.
    if isinstance(sd, tuple) or (
        isinstance(sd, list) and any(type(v) not in SCALARS for v in sd) and terminal(sd)
    ):
        return tuple(walk([sd], None).items())  # in a list: the walk of a list of it pickles it whole
    if isinstance(sd, list):
        new_list = [staged_form(v) for v in sd]
        return sd if all(a is b for a, b in zip(new_list, sd, strict=True)) else new_list
    return sd


def _leaves(sd: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], torch.Tensor]]:
    """(path, tensor) of every plain, non-empty tensor in dicts and lists (tuples cannot share a buffer)."""
    if plain(sd):
        return [(path, sd)] if sd.numel() else []
    if isinstance(sd, dict):
        return [leaf for k, v in sd.items() for leaf in _leaves(v, (*path, k))]
    if isinstance(sd, list):
        return [leaf for i, v in enumerate(sd) for leaf in _leaves(v, (*path, i))]
    return []


def _ties(sd: Any) -> list[tuple[int, int]]:
    """Pairs (i, j) of leaf positions that are the very same tensor (tied weights), j > i."""
    first: dict[Alias, int] = {}
    out = []
    for i, (_, t) in enumerate(_leaves(sd)):
        key = alias(t)
        if key in first:
            out.append((first[key], i))
        else:
            first[key] = i
    return out


def own_copies(sd: Any, buffers: Any) -> Any:
    """``buffers`` with every tensor item that is the live item itself replaced by a private host copy.

    torch's ``_create_cpu_state_dict`` returns a 0-d DTensor as it is (an FSDP2 / tensor-parallel scalar
    parameter, its Adam moments): staged into itself, the snapshot then *was* the live DTensor, and the
    next optimizer step, run while the background write was still reading it, reached the committed
    checkpoint (a value from a later step: a bitwise resume broken without a sign). Every other item it
    allocates anew (0-d and zero-size plain tensors, DTensors with an empty local shard, ShardedTensors
    with local shards; a tensor on 'meta' gets a zero CPU buffer, and its copy then fails the save: there
    are no bytes to save). A ShardedTensor without local shards is returned as is too, and kept: this rank
    holds none of its bytes, so it writes nothing of it (untested: in a world of one, every ShardedTensor
    has local shards). Walked once per buffer set (at allocation), never per save."""
    if isinstance(buffers, torch.Tensor):
        if buffers is sd and not isinstance(buffers, ShardedTensor):
            return buffers.detach().to("cpu", copy=True)  # a DTensor stays one (same mesh and placements)
        return buffers
    if isinstance(buffers, dict):
        for k, b in buffers.items():
            buffers[k] = own_copies(sd[k], b)
        return buffers
    if isinstance(buffers, list):
        buffers[:] = [own_copies(s, b) for s, b in zip(sd, buffers, strict=True)]
        return buffers
    if isinstance(buffers, tuple):
        return tuple(own_copies(s, b) for s, b in zip(sd, buffers, strict=True))
    return buffers


def tie_buffers(sd: Any, buffers: Any) -> None:
    """Give tied tensors one buffer: staged once, written once (store/incremental.py writes an item that
    is the same view of the same memory as another once), and both keys load."""
    live, bufs = _leaves(sd), _leaves(buffers)
    for i, j in _ties(sd):
        path, shared = bufs[j][0], bufs[i][1]
        if len(bufs) != len(live) or not path:
            return
        container = buffers
        for k in path[:-1]:
            container = container[k]
        container[path[-1]] = shared
