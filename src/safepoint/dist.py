"""safepoint's own collectives, on a gloo group created for the purpose.

Training may run NCCL; our agreement and commit traffic is small and CPU-side, and must never queue behind
(or hang) the training group's kernels. Every collective here is bounded by ``timeout``: a vanished peer
makes the others fail with a clear error instead of waiting forever. DCP's own collectives run on the same
group (``process_group=comm.group``), so they are bounded by the same timeout: gloo enforces it per
operation ("Timed out waiting 3000ms for send operation to complete", measured with torch 2.13).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
import warnings
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from safepoint.errors import CheckpointError

T = TypeVar("T")
log = logging.getLogger("safepoint")


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
                f"safepoint: {what} among {self.world_size} ranks failed: a rank died, or did not answer "
                f"within the collective timeout of {self.timeout_s:g}s ({e}). A save in progress is not "
                "committed; restart the job to resume from the last committed checkpoint."
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


class Agreement:
    """Ranks agree on a rank-local flag (a time-based save being due) without talking every step.

    A broadcast on every ``maybe_save`` costs a collective per training step. Instead ranks exchange the
    flag only at *check steps*: the first call, then every ``k`` steps, where ``k`` is re-agreed at each
    check as the smallest, over ranks, of how many steps fit in ``target_s`` at that rank's measured step
    time. Which steps are check steps is therefore the same on every rank (it depends only on the step
    numbers and on values exchanged at checks), and a flag raised between checks acts at the next check:
    at most about ``target_s`` (or one step, if steps are slower) late.
    """

    MAX_EVERY = 10_000

    def __init__(self, comm: Comm, target_s: float) -> None:
        self.comm = comm
        self.target_s = target_s
        self.checks = 0
        self._next: int | None = None  # the next check step; None: check at the next call
        self._last_step = 0
        self._last_time = 0.0

    def agree(self, step: int, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank at this check step; False between checks."""
        if not self.comm.distributed:
            return flag
        if self._next is not None and self._last_step <= step < self._next:
            return False  # the same decision on every rank: no check at this step
        now = time.monotonic()
        every = 1
        if self._next is not None and step > self._last_step and now > self._last_time:
            per_step = (now - self._last_time) / (step - self._last_step)
            every = max(1, min(self.MAX_EVERY, int(self.target_s / per_step)))
        # One all_reduce(MAX) carries both the flag and -every (max of -every = min of every).
        t = torch.tensor([1 if flag else 0, -every], dtype=torch.int64)
        self.comm._run("all_reduce", lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.comm.group))
        self.checks += 1
        self._next = step + int(-t[1])
        self._last_step, self._last_time = step, now
        return bool(t[0])


_ATTEMPT_PREFIX = "safepoint/attempt_"


def init_process_group(backend: str | None = None, *, timeout_s: float | None = None, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` that survives torchrun restarts (``--max-restarts``).

    torchrun's c10d rendezvous hands every worker generation the same agent-hosted TCPStore
    (``TORCHELASTIC_USE_AGENT_STORE=True``), without a per-attempt namespace. Keys the dead attempt wrote
    (gloo's ``default_pg/0//cpu//0/<rank>`` peer addresses, NCCL's unique id) are still there, so a
    restarted rank can read its peer's *old* address before the new one overwrites it and fail with
    "Connection refused" or time out. This function keys the default group's store by
    ``TORCHELASTIC_RESTART_COUNT`` when that count is the same on every rank (a single-node job); for
    multi-node jobs it falls back to the plain call and warns: launch those with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment instead (a fresh store per
    rendezvous round). Outside torchrun, or with an explicit ``store``/``init_method``, it is exactly
    ``dist.init_process_group``.
    """
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    env = os.environ
    if (
        env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        or "store" in kwargs
        or "init_method" in kwargs
        or "MASTER_ADDR" not in env
    ):
        dist.init_process_group(backend, **kwargs)
        return
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    if int(env.get("LOCAL_WORLD_SIZE", "0")) != world_size:
        # Each node's agent counts its own restarts, and restarts caused by membership changes are not
        # counted at all, so the restart count cannot name an attempt consistently across nodes.
        if rank == 0:
            warnings.warn(
                "safepoint.init_process_group: multi-node torchrun with a shared agent store; restarted "
                "workers may read peer addresses left by the failed attempt and fail to connect. Set "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment.",
                RuntimeWarning,
                stacklevel=2,
            )
        dist.init_process_group(backend, **kwargs)
        return
    timeout = kwargs.get("timeout", datetime.timedelta(minutes=10))
    client = TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = PrefixStore(f"{_ATTEMPT_PREFIX}{attempt}", client)
    log.debug("safepoint: default process group store keyed by attempt %s", attempt)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)
