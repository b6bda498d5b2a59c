"""What a load that failed part-way left in the live state, and whether the fallback overwrote it.

Tensors are read in place, and a file's crc32c is known only once it has been read to its end: a
checkpoint found damaged while it is read (it verified, then a file changed) has already written into the
state. The older checkpoint the restore falls back to overwrites those tensors only if it holds the same
keys; one that lacks some (a named section added later, ``strict=False``, ``ignore``) would leave bytes of
no verified checkpoint there. Putting their old values back would need a copy of the state before every
restore (twice the memory, on the accelerator, for an event that needs a file changed between verify and
read), so the restore fails instead, naming the keys: the objects must be recreated. Nothing is copied.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from safepoint.errors import CheckpointError
from safepoint.restore.partial import Plan, plain_key
from safepoint.state import RNG

_SHOW = 8


def written_keys(template: dict[str, Any], matched: Plan | None) -> frozenset[str]:
    """The state keys whose tensors a load of ``template`` (or of ``matched``) writes into in place, without
    their rank (``extra.rank_1.t`` is ``extra.t``: the same object whichever saved rank is read). RNG state
    is captured into new tensors, never the live generator's: not counted."""
    if matched is not None:
        keys = [t for t, s in matched.pairs if isinstance(matched.to_load[s], torch.Tensor)]
    else:
        flat, _ = flatten_state_dict(template)
        keys = [k for k, v in flat.items() if isinstance(v, torch.Tensor)]
    return frozenset(plain_key(k) for k in keys if not k.startswith(RNG + "."))


class Leftover:
    """The keys that loads found damaged while read wrote into, during one restore."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.steps: list[int] = []

    def failed(self, step: int, keys: frozenset[str]) -> None:
        self.keys |= keys
        self.steps.append(step)

    def check(self, step: int, loaded: frozenset[str]) -> None:
        """``step`` loaded ``loaded``; raise if a damaged load wrote a key it did not overwrite. The keys
        are the same on every rank (the state's structure is), so every rank decides alike."""
        left = sorted(self.keys - loaded)
        if not left:
            return
        shown = ", ".join(left[:_SHOW]) + (f", ... (+{len(left) - _SHOW} more)" if len(left) > _SHOW else "")
        damaged = ", ".join(str(s) for s in self.steps)
        raise CheckpointError(
            f"checkpoint step {damaged} was found damaged while it was read, after part of it had been "
            f"read into the state; the fallback, step {step}, does not hold {len(left)} of the keys it "
            f"wrote, which now hold bytes of no verified checkpoint: {shown}. Recreate the objects being "
            "restored into and restore again (every checkpoint is verified again first)"
        )
