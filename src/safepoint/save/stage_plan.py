"""One walk of a captured state per async save, and the (live tensor, buffer) pairing it proves still valid.

An async save blocks the loop for capture and staging, and staging's Python work per tensor used to cost
several times the copy itself with thousands of tensors (issue 27: 20x a plain copy of 9,000 tensors on
CPU, docs/benchmarks.md): four walks of the state per save (the tie check, the structure check, the
snapshot, the copy loop), one ``copy_`` launched per tensor. Now a save walks the state once (``walk``),
and that walk gives both the snapshot (the buffers in place of the tensors, any other value a copy of its
own, a BytesIO too: no value of a snapshot is the live object) and a **signature** of the state's
structure: each container's kind and keys (or length), a marker for each other value, and per tensor what
makes it the very same tensor (device, data_ptr, dtype, shape, strides, conj and neg bits; a DTensor also
its mesh, placements and global shape; inside a value DCP pickles whole, a tuple, each storage instead,
save/pickled.py). The buffers are paired with the tensors by position in the walk, in
a ``Plan``, which holds the signature of the state it was made for; a save reuses it when its own signature
is equal, item for item (``fits``), or differs only in where plain tensors live, not in their device, dtype,
shape or ties (``refit``: a tensor replaced by another like it). Any other change (a tensor resized, moved,
its dtype changed, a key added or removed, a tie made or undone) and the stager allocates and pairs
afresh: never a stale pairing. The data_ptr is in it because ties are found by it and the incremental check
(save/staging.py) trusts a version counter only for the same memory.

Equal signatures prove the pairing because the walk visits everything in order: the i-th tensor of two
walks with equal signatures is at the same place in the state (the containers, their keys and lengths are
the same up to it), so the i-th buffer was made for that place, with the same shape and dtype (what makes
the copy exact: ``copy_`` would broadcast a smaller tensor or convert a dtype, silently), and the same ties.

A dict whose keys come in another order (the same keys) moves every item after it, so by position alone it
got new buffers at every save. ``Plan.rekeyed`` re-pairs by key first: it rewrites the plan's own signature
in the new key order (each leaf's token still that of the state the buffers were made for, moved with its
key path), and every buffer, slot, tie and incremental record with it. That plan describes exactly the old
state reordered, so ``fits``/``refit`` decide as for any plan: a reorder alone keeps every buffer and what
the last staging proved; with any other change it is judged as that change would be. It runs only where
the signature already differs.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from safepoint.save.kinds import DICT as _DICT
from safepoint.save.kinds import DTENSOR as _DTENSOR
from safepoint.save.kinds import LIST as _LIST
from safepoint.save.kinds import PLAIN_TYPES as _PLAIN_TYPES
from safepoint.save.kinds import SCALARS as _SCALARS
from safepoint.save.kinds import TUPLE as _TUPLE
from safepoint.save.kinds import Walked as Walked
from safepoint.save.kinds import alias, opaque_token, plain, same_kind
from safepoint.save.pickled import Pickled, terminal
from safepoint.save.shared_buffers import buffer_tensors

_STRIDED = torch.strided


def walk(sd: Any, slots: Sequence[Any] | None) -> Walked:
    """Walk ``sd``: its signature, its tensor items, and its snapshot with ``slots[i]`` in place of the i-th
    tensor item (the item itself where ``slots`` has none: a walk to be redone once buffers exist).

    This runs on every async save, inside the loop's blocking time, once per item of the state: the plain
    tensors and plain values in a dict or list are handled in its loop, without a call of their own. A
    plain tensor's signature item is (device, data_ptr, dtype, shape, strides); its conj and neg bits
    matter only where two items share all of those (a tie), and ``Plan.fits`` checks them there."""
    out = Walked()
    out.snapshot = _Walker(out, slots).visit(sd)
    return out


class _Walker:
    """``walk``'s recursion (a class, not a closure: a recursive closure is a reference cycle, which would
    keep each walk's signature, tensors and snapshot alive until the cyclic collector ran, ~40,000 objects
    per save at 9,000 tensors, collected inside a later save's blocking time)."""

    __slots__ = ("have", "out", "slots")

    def __init__(self, out: Walked, slots: Sequence[Any] | None) -> None:
        self.out, self.slots = out, slots
        self.have = len(slots) if slots is not None else 0

    def visit(self, v: Any) -> Any:
        kind = type(v)
        out, slots, have = self.out, self.slots, self.have
        append, leaves = out.tokens.append, out.leaves
        keep = leaves.append
        if kind is dict or (kind not in _PLAIN_TYPES and isinstance(v, dict)):
            append((_DICT, *v))
            new = {}
            for k, x in v.items():
                t = type(x)
                if t in _PLAIN_TYPES and x.layout is _STRIDED:
                    i = len(leaves)
                    append((x.device, x.data_ptr(), x.dtype, x.shape, x.stride()))
                    keep(x)
                    new[k] = slots[i] if i < have else x  # type: ignore[index]
                elif t in _SCALARS:
                    append(None)
                    new[k] = x
                else:
                    new[k] = self.visit(x)
            # A plain dict even for a model's OrderedDict: DCP stores a dict's keys, never its type (and
            # OrderedDict(new) at 9,000 keys cost 2-6 ms of the loop's wait per save).
            return new
        if kind is list or kind is tuple or (kind not in _PLAIN_TYPES and isinstance(v, (list, tuple))):
            if kind is not list and isinstance(v, tuple):
                return Pickled(out, slots, have).visit(v)  # one pickled value (save/pickled.py)
            mark = len(out.tokens)
            append((_LIST, len(v)))
            seq = []
            probe = True
            for x in v:
                t = type(x)
                if t in _PLAIN_TYPES and x.layout is _STRIDED:
                    i = len(leaves)
                    append((x.device, x.data_ptr(), x.dtype, x.shape, x.stride()))
                    keep(x)
                    seq.append(slots[i] if i < have else x)  # type: ignore[index]
                elif t in _SCALARS:
                    append(None)
                    seq.append(x)
                else:
                    # A list that holds no tensor and no dict (tuples, lists of numbers) is one pickled
                    # value too; only a list with more than numbers and strings in it is asked (rarely).
                    if probe and terminal(v):
                        del out.tokens[mark:]  # no tensor before this item: nothing else to take back
                        return Pickled(out, slots, have).visit(v)
                    probe = False
                    seq.append(self.visit(x))
            return seq if kind is list else same_kind(kind, seq)
        if kind in _SCALARS:
            append(None)
            return v
        i = len(leaves)
        if kind in _PLAIN_TYPES and v.layout is _STRIDED:
            append((v.device, v.data_ptr(), v.dtype, v.shape, v.stride()))
            keep(v)
        elif isinstance(v, DTensor) and plain(local := v._local_tensor):
            append((_DTENSOR, v.device_mesh, tuple(v.placements), v.shape, v.stride(), alias(local)))
            keep(local)
            out.wrapped[i] = v
        elif isinstance(v, torch.Tensor):
            append(opaque_token(v))
            keep(v)
            out.opaque.append(i)
        else:
            append(None)
            # Its own copy, as torch's _copy_state_dict(type_check=False) makes of any other value; a BytesIO
            # too (position and all), which torch passes on as it is: no later write may reach the snapshot.
            return copy.deepcopy(v)
        return slots[i] if i < have else v  # type: ignore[index]


def cuda_devices(walked: Walked) -> set[torch.device]:
    """The CUDA devices of a walk's tensors (a ShardedTensor's: of its local shards)."""
    out = {t.device for t in walked.leaves if isinstance(t, torch.Tensor) and t.is_cuda}
    for i in walked.opaque:
        out |= {t.device for t in buffer_tensors(walked.leaves[i]) if t.is_cuda}
    return out


class Plan:
    """The pairing of a state's tensors with one buffer set, valid for the walks it ``fits``.

    Built once per buffer set (``Stager`` makes a new one whenever it allocates); per save, ``lives`` picks
    the walk's tensors to copy, in the order of ``targets``."""

    def __init__(self, walked: Walked, buffers: Any, mine: Walked | None = None) -> None:
        """``mine``: ``walk(buffers, None)`` where the caller has it already (re-homing a buffer's memory
        keeps its object: the walk still pairs)."""
        if mine is None:
            mine = walk(buffers, None)
        if len(mine.leaves) != len(walked.leaves):
            raise RuntimeError("staging buffers do not mirror the state (a bug in safepoint)")
        self._pair(walked.tokens, mine.leaves, mine.items(), walked.opaque, cuda_devices(walked))
        self._sized([alias(t) for t in self.targets], [t.numel() * t.element_size() for t in self.targets])
        self.shared = _shared(walked, self._leaf_of)
        """The plain items that share memory and view with another (ties), grouped, with their conj and
        neg bits: what makes them one tensor (one buffer) or two."""

    def _pair(
        self, tokens: list[Any], leaves: list[Any], slots: list[Any], opaque: list[int], devices: Any
    ) -> None:
        """Pair the items of a state of signature ``tokens`` with the buffers: ``leaves[i]`` is what the i-th
        item's copy writes (``walk``'s leaves of the buffers), ``slots[i]`` what stands in its snapshot."""
        self.tokens = tokens
        self.slots: list[Any] = slots
        """Per tensor item: what stands in the snapshot (the buffer, or the DTensor over it)."""
        skip = set(opaque)
        self.opaque = [(i, slots[i]) for i in opaque]
        """(position, buffer) of each item torch's ``_copy_state_dict`` copies (not incremental)."""
        firsts: list[int] = []
        self._target_of: dict[int, int] = {}  # item position -> index of its target (a tie: shared)
        index: dict[int, int] = {}
        for i, target in enumerate(leaves):
            if i in skip:
                continue
            k = index.get(id(target))
            if k is None:  # a tied item's buffer is its first item's: copied once
                k = index[id(target)] = len(firsts)
                firsts.append(i)
            self._target_of[i] = k
        self.positions = firsts
        self.whole = len(firsts) == len(leaves)  # no ties, nothing opaque: the walk's own list
        self.targets: list[torch.Tensor] = [leaves[i] for i in firsts]
        """The plain buffer tensors the batched copy writes, one per distinct tensor."""
        self._leaf_of = {j: i for i, j in enumerate(_leaf_tokens(tokens))}
        self.devices = devices
        """The CUDA devices the state lives on (the copy's stream); fixed by the signature."""
        self.aliases: list[tuple[Any, ...]] = []
        self.nbytes: list[int] = []
        # Incremental staging (save/staging.py), per target: the live tensor's version counter when it was
        # last staged (None: not seen since its memory changed), and the fingerprint of the bytes the
        # buffer holds (None: not known). ``still``: the targets the last staging proved unchanged.
        self.versions: list[int | None] | None = None
        self.held: list[bytes | None] = [None] * len(firsts)
        self.still: set[int] = set()

    def _sized(self, aliases: list[tuple[Any, ...]], nbytes: list[int]) -> None:
        """Per target: its alias (the fingerprints' key) and its size in bytes."""
        self.aliases, self.nbytes = aliases, nbytes
        self.unhashed: dict[tuple[Any, ...], bytes | None] = dict.fromkeys(aliases)  # none hashed

    def rekeyed(self, walked: Walked) -> Plan | None:
        """This pairing for the state it was made for with its dicts' keys in ``walked``'s order: the same
        buffers, each still paired with the item at the key path it was made for, and the incremental
        records with them. None where ``walked`` differs by more than the order of keys (another key, a
        container or a list length): then no pairing by key exists. Whether the reordered pairing takes
        ``walked`` is, as for this one, for ``fits`` or ``refit`` to say."""
        found = _rekeyed(self.tokens, walked.tokens, self._leaf_of)
        if found is None:
            return None
        tokens, perm = found  # perm[i]: the position in this pairing of the new i-th item
        new = {p: i for i, p in enumerate(perm)}
        opaque = dict(self.opaque)
        leaves = [opaque[p] if p in opaque else self.targets[self._target_of[p]] for p in perm]
        plan = Plan.__new__(Plan)
        plan._pair(
            tokens, leaves, [self.slots[p] for p in perm], sorted(new[p] for p in opaque), self.devices
        )
        groups = sorted(tuple(sorted(new[p] for p in group)) for group in self.shared[0])
        bits = {new[p]: (c, n) for p, c, n in self.shared[1]}
        plan.shared = groups, [(i, *bits[i]) for group in groups for i in group]
        was = {id(t): k for k, t in enumerate(self.targets)}
        ks = [was[id(t)] for t in plan.targets]  # the same buffers (a tie's first item may have changed)
        plan._sized([self.aliases[k] for k in ks], [self.nbytes[k] for k in ks])
        plan.versions = None if self.versions is None else [self.versions[k] for k in ks]
        plan.held = [self.held[k] for k in ks]
        plan.still = {i for i, k in enumerate(ks) if k in self.still}
        return plan

    def fits(self, walked: Walked) -> bool:
        """Whether ``walked`` is of exactly the state this pairing was made for: the same signature, and
        the same conj and neg bits where two items share memory and view (whether they are one tensor)."""
        if walked.tokens != self.tokens:
            return False
        leaves = walked.leaves
        return all(leaves[i].is_conj() == c and leaves[i].is_neg() == n for i, c, n in self.shared[1])

    def refit(self, walked: Walked) -> bool:
        """Take ``walked`` if its state differs from this pairing's only in where plain tensors live (a
        tensor replaced by another of the same device, dtype and shape: its strides may differ too, the
        copy does not care) and not in which items are one tensor: the buffers still fit, item for item.
        The replaced tensors' version counters are forgotten (another tensor's counter says nothing about
        this one's bytes: the next staging fingerprints them). False: new buffers are needed."""
        new, old = walked.tokens, self.tokens
        if len(new) != len(old):
            return False
        changed = [j for j, (a, b) in enumerate(zip(new, old, strict=True)) if a != b]
        for j in changed:
            a, b = new[j], old[j]
            if not (_is_plain_token(a) and _is_plain_token(b)) or (a[0], a[2], a[3]) != (b[0], b[2], b[3]):
                return False
        if _shared(walked, self._leaf_of) != self.shared:
            return False  # a tie made or undone: the buffers' sharing would be wrong
        if self.versions is not None:
            for j in changed:
                k = self._target_of.get(self._leaf_of[j])
                if k is not None:
                    self.versions[k] = None
        self.tokens = new
        return True

    def forget(self) -> None:
        """Drop the incremental records: the next staging fingerprints or copies every tensor afresh."""
        self.versions, self.held, self.still = None, [None] * len(self.targets), set()

    def lives(self, walked: Walked) -> list[torch.Tensor]:
        """The walk's tensors in the order of ``targets``."""
        leaves = walked.leaves
        return leaves if self.whole else [leaves[i] for i in self.positions]


def _is_plain_token(token: Any) -> bool:
    return type(token) is tuple and len(token) == 5 and type(token[0]) is torch.device


def _leaf_tokens(tokens: list[Any]) -> list[int]:
    """Where in a signature the tensor items are, in walk order (every item but containers' and plain
    values')."""
    return [
        j for j, t in enumerate(tokens) if type(t) is tuple and t[0] is not _DICT and t[0] is not _LIST
        and t[0] is not _TUPLE
    ]  # fmt: skip


def _container(token: Any) -> Any:
    """The tag of a container's signature item (``_DICT``, ``_LIST``, ``_TUPLE``), None for any other."""
    tag = token[0] if type(token) is tuple and token else None
    return tag if tag is _DICT or tag is _LIST or tag is _TUPLE else None


def _rekeyed(old: list[Any], new: list[Any], leaf_at: dict[int, int]) -> tuple[list[Any], list[int]] | None:
    """``old`` (a signature) with the entries of each dict in the order of the same dict in ``new``, and
    where each tensor item went (result position -> position in ``old``); None where the two differ by more
    than the order of dict keys: another key set, container kind or length, or a container for a leaf.
    Leaves are ``old``'s own: whether they are ``new``'s is left to the comparison that follows.
    ``leaf_at``: the position of each tensor item's token in ``old`` -> its position among the items."""
    if len(old) != len(new):
        return None
    tags = [_container(t) for t in old]
    ends = list(range(1, len(old) + 1))  # where the item starting at each position ends
    for j in range(len(old) - 1, -1, -1):
        tag = tags[j]
        if tag is not None:
            end = j + 1
            for _ in range(len(old[j]) - 1 if tag is _DICT else old[j][1]):
                end = ends[end]
            ends[j] = end
    out: list[Any] = []
    perm: list[int] = []
    pending = [0]  # the positions in ``old`` of the items ``new`` has next, the next one last
    for token in new:
        if not pending:
            return None
        j = pending.pop()
        was, tag = old[j], _container(token)
        if tag is None:
            if tags[j] is not None:
                return None
            out.append(was)
            if j in leaf_at:
                perm.append(leaf_at[j])
            continue
        if tags[j] is not tag:
            return None
        starts, at = [], j + 1
        for _ in range(len(was) - 1 if tag is _DICT else was[1]):
            starts.append(at)
            at = ends[at]
        if tag is _DICT:
            where = dict(zip(was[1:], starts, strict=True))
            if len(token) != len(was) or not all(k in where for k in token[1:]):
                return None
            starts = [where[k] for k in token[1:]]
        elif token != was:
            return None  # another length
        out.append(token)
        pending.extend(reversed(starts))
    return (out, perm) if not pending else None


Shared = tuple[list[tuple[int, ...]], list[tuple[int, bool, bool]]]


def _shared(walked: Walked, leaf_of: dict[int, int]) -> Shared:
    """The groups of plain items with the same (device, data_ptr, dtype, shape, strides), and the conj and
    neg bits of each of their items: whether two items are one tensor (``alias``) is decided by these."""
    skip = set(walked.opaque) | set(walked.wrapped)
    groups: dict[Any, list[int]] = {}
    tokens = walked.tokens
    for j, i in leaf_of.items():
        if i not in skip:
            groups.setdefault(tokens[j], []).append(i)
    shared = sorted(tuple(group) for group in groups.values() if len(group) > 1)
    leaves = walked.leaves
    return shared, [(i, leaves[i].is_conj(), leaves[i].is_neg()) for group in shared for i in group]
