"""safepoint's own collectives, on a gloo group created for the purpose.

Training may run NCCL; our agreement and commit traffic is small and CPU-side, and must never queue behind
(or hang) the training group's kernels. Every collective here is bounded by ``timeout``: a vanished peer
makes the others fail with a clear error instead of waiting forever.
"""

from __future__ import annotations

import datetime
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from safepoint.errors import CheckpointError

T = TypeVar("T")


class PeerTimeoutError(CheckpointError):
    """A collective among ranks did not complete in time (a rank died or hung)."""


class Comm:
    """Rank, world size and bounded collectives; trivial when there is no process group."""

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group: dist.ProcessGroup | None = None
        if self.distributed:
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()
            # Collective: every rank constructs its manager at the same point, as with any new_group.
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        else:
            self.rank = 0
            self.world_size = 1

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def _run(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except RuntimeError as e:
            raise PeerTimeoutError(
                f"safepoint: {what} among {self.world_size} ranks failed or timed out after "
                f"{self.timeout_s:.0f}s ({e}); a rank probably died. Nothing was committed; restart the job "
                "to resume from the last committed checkpoint."
            ) from e

    def broadcast(self, obj: T, src: int = 0) -> T:
        if not self.distributed:
            return obj
        box = [obj]
        self._run(
            "broadcast", lambda: dist.broadcast_object_list(box, src=self._global(src), group=self.group)
        )
        return box[0]

    def all_gather(self, obj: T) -> list[T]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        self._run("all_gather", lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def any(self, flag: bool) -> bool:
        """True on every rank if it is true on any rank (one small all_reduce)."""
        if not self.distributed:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        self._run("all_reduce", lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group))
        return bool(t.item())

    def barrier(self, what: str = "barrier") -> None:
        if self.distributed:
            self._run(what, lambda: dist.barrier(group=self.group))

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def destroy(self) -> None:
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
            self.group = None
