"""ResumableSampler: a DistributedSampler whose position in the epoch survives a change of world size.

``DistributedSampler`` gives rank ``r`` the indices ``perm[r::W]``; resuming it at another ``W`` either
replays or skips samples. This sampler records the *global* position in the epoch instead: the number of
leading entries of the epoch's permutation that every rank together has consumed. Rank ``r`` of ``W`` then
iterates ``perm[position + r :: W]``, so a resume at any world size continues with exactly the next unseen
samples.

Position tracking assumes data parallel lockstep (every rank consumes the same number of indices between
saves), which synchronous training guarantees. Two ways to count what was consumed:

* by default, what this sampler's iterator has yielded: exact with ``DataLoader(num_workers=0)`` and with
  torchdata's ``StatefulDataLoader`` (which snapshots ``state_dict()`` right after drawing each batch's
  indices and hands out the snapshot that matches the batch it yields);
* after any call to :meth:`ResumableSampler.advance`, what the training loop reported: needed with a plain
  multi-worker ``DataLoader``, whose workers prefetch batches the loop has not trained on yet.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

_FIELDS = ("dataset_size", "shuffle", "seed", "drop_last")


class ResumableSampler(Sampler[int]):
    """Drop-in for ``torch.utils.data.DistributedSampler`` (map-style datasets) that resumes exactly.

    Args:
        dataset_size: number of samples in the dataset (``len(dataset)``).
        shuffle: shuffle with ``torch.randperm`` seeded by ``seed + epoch`` (as DistributedSampler).
        seed: base seed; must be the same on every rank and across restarts.
        drop_last: drop the tail that does not divide evenly among the ranks; otherwise pad it with
            repeats from the start of the remaining samples (as DistributedSampler).
        rank: this rank; defaults to the default process group's, or 0 without one.
        world_size: the number of ranks; defaults to the default process group's, or 1 without one.

    Use it like DistributedSampler (``DataLoader(dataset, sampler=s)``, ``s.set_epoch(epoch)`` before each
    epoch) and put it in ``TrainState(dataloader=s)``. ``set_epoch`` with the epoch the sampler already is
    in keeps the restored position, so the usual loop resumes mid-epoch without special code. A restored
    position is used by the next iteration only; later iterations of the same epoch start from its
    beginning, as DistributedSampler's do.
    """

    def __init__(
        self,
        dataset_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if isinstance(dataset_size, bool) or not isinstance(dataset_size, int) or dataset_size < 0:
            raise ValueError(f"dataset_size must be a non-negative int, got {dataset_size!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        distributed = dist.is_available() and dist.is_initialized()
        if world_size is None:
            world_size = dist.get_world_size() if distributed else 1
        if rank is None:
            rank = dist.get_rank() if distributed else 0
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        self.dataset_size = dataset_size
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self._resume: int | None = None  # global position the next iteration starts from (restored)
        self._active = False  # an iteration of this epoch has started
        self._start = 0  # global position at which the current iteration started
        self._per_rank = 0  # indices the current iteration yields on each rank
        self._yielded = 0
        self._use_advance = False
        self._advanced = 0
        self._generation = 0  # iterators of an earlier iteration no longer move the position
        self._workers = 0  # worker processes of the DataLoader that iterates this sampler (0: none seen)

    # ---- the DistributedSampler interface -------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch. A new epoch starts at its beginning; the current one keeps its position."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        if epoch != self.epoch:
            self.epoch = epoch
            self._resume = None
            self._active = False

    def __iter__(self) -> Iterator[int]:
        start = self._resume if self._resume is not None else 0
        self._resume = None
        indices = self._rank_indices(start)
        self._active = True
        self._start = start
        self._per_rank = len(indices)
        self._yielded = 0
        self._advanced = 0
        self._generation += 1
        self._workers = _loader_workers()
        return self._generate(indices, self._generation)

    def __len__(self) -> int:
        """Indices the next iteration yields on this rank (the rest of the epoch after a restore)."""
        start = self._resume if self._resume is not None else 0
        return self._share(self.dataset_size - start)

    # ---- consumption ---------------------------------------------------------------------------------

    def advance(self, num_samples: int) -> None:
        """Report that the training loop consumed ``num_samples`` more of this rank's samples.

        Only needed with a multi-worker ``DataLoader``: its workers draw indices batches ahead of training,
        so the iterator's count overstates progress. Call it after every batch (with the batch's number of
        samples on this rank); from the first call on, the saved position follows these reports.
        """
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
            raise ValueError(f"num_samples must be a non-negative int, got {num_samples!r}")
        if not self._active:
            raise ValueError("ResumableSampler.advance() called before iterating the sampler in this epoch")
        if self._advanced + num_samples > self._yielded:
            raise ValueError(
                f"ResumableSampler.advance({num_samples}): this rank would have consumed "
                f"{self._advanced + num_samples} samples, but only {self._yielded} were drawn in this "
                "epoch; pass the per-rank batch size, not the global one"
            )
        self._use_advance = True
        self._advanced += num_samples

    @property
    def position(self) -> int:
        """Samples of the current epoch consumed by all ranks together (``dataset_size`` when done)."""
        if self._resume is not None:
            return self._resume
        if not self._active:
            return 0
        done = self._advanced if self._use_advance else self._yielded
        if done >= self._per_rank:
            return self.dataset_size
        return self._start + done * self.world_size

    # ---- Stateful ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The same on every rank (in lockstep): safe to load at any world size.

        Raises ValueError if a multi-worker ``DataLoader`` iterates this sampler and the loop never called
        :meth:`advance`: the workers draw indices ahead of training, so the position would skip samples
        never trained on (a resume then silently diverges)."""
        if self._workers and self._active and self._yielded and not self._use_advance:
            raise ValueError(
                f"ResumableSampler: a DataLoader with num_workers={self._workers} iterates this sampler, "
                "and its workers draw indices batches ahead of training, but the training loop never "
                "reported what it consumed: call sampler.advance(samples_in_batch) after every batch (or "
                "use torchdata's StatefulDataLoader); the saved position would skip samples never trained on"
            )
        return {
            "epoch": self.epoch,
            "position": self.position,
            "dataset_size": self.dataset_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for field in _FIELDS:
            if field in state_dict and state_dict[field] != getattr(self, field):
                # The position indexes one specific permutation; under another it means nothing.
                raise ValueError(
                    f"ResumableSampler: the saved {field}={state_dict[field]!r} differs from this sampler's "
                    f"{getattr(self, field)!r}; the saved position cannot be applied"
                )
        epoch = int(state_dict["epoch"])
        position = int(state_dict["position"])
        if epoch < 0 or not 0 <= position <= self.dataset_size:
            raise ValueError(f"ResumableSampler: invalid saved state epoch={epoch}, position={position}")
        self.epoch = epoch
        self._resume = position
        self._active = False

    # ---- internals -----------------------------------------------------------------------------------

    def _share(self, remaining: int) -> int:
        if remaining <= 0:
            return 0
        if self.drop_last:
            return remaining // self.world_size
        return math.ceil(remaining / self.world_size)

    def _rank_indices(self, start: int) -> list[int]:
        n = self.dataset_size
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g)
        else:
            order = torch.arange(n)
        rest = order[start:]
        per = self._share(len(rest))
        total = per * self.world_size
        if total <= len(rest):
            rest = rest[:total]
        else:
            # Pad by repeating the remaining samples from their start, as DistributedSampler does.
            reps = math.ceil(total / len(rest))
            rest = rest.repeat(reps)[:total]
        out: list[int] = rest[self.rank :: self.world_size].tolist()
        return out

    def _generate(self, indices: list[int], generation: int) -> Iterator[int]:
        for i in indices:
            if generation == self._generation:
                self._yielded += 1
            yield i


def _loader_workers() -> int:
    """The ``num_workers`` of torch's multi-worker DataLoader iterator drawing from this sampler right now,
    or 0. Its main process draws every index (``_next_index``) ahead of the batches it hands out; the
    iterator is found on the call stack, as torch exposes no link from a sampler to its loader."""
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    frame: FrameType | None = sys._getframe(1)
    for _ in range(12):  # __iter__ <- BatchSampler.__iter__ <- _next_index <- _try_put_index: a few frames
        if frame is None:
            return 0
        owner = frame.f_locals.get("self")
        if isinstance(owner, _MultiProcessingDataLoaderIter):
            return int(owner._num_workers)
        frame = frame.f_back
    return 0
