"""ReplayLoader: any DataLoader resumes at the exact batch, its worker seeds and shuffle order included.

A framework's DataLoader (Accelerate's ``DataLoaderShard``, the one the Transformers Trainer builds) draws
two things from random state when an epoch's iteration starts: the shuffle order (a sampler seeded from the
global torch RNG, or from a generator of its own) and the workers' base seed (``torch.initial_seed()`` in
every worker is ``base_seed + worker_id``). Skipping batches after a resume
(``accelerate.skip_first_batches``) builds another batch sampler: the order may survive, but the workers'
seeds and which worker loads which batch do not, so every random augmentation in a worker differs from the
uninterrupted run.

This wrapper keeps, per rank, the epoch, the batches consumed in it, and the random state the epoch's
iteration started from (the torch RNG and every ``torch.Generator`` the loader's sampler uses). On resume it
sets that state back, starts the epoch's iteration as the first run did, draws and drops the consumed
batches (each worker loads the batches it loaded then, with the seeds it had then), and puts the training
RNG back to the restored one. The cost of exactness: the consumed batches of the current epoch are loaded
again, without training on them.

The epoch is counted here, not by the caller: every ``iter()`` after a finished iteration is the next
epoch. ``set_epoch`` from a framework (the Trainer's count restarts at 0 after a resume) is ignored; the
loader's own ``set_epoch`` is called with this count.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

EPOCH = "epoch"
BATCHES = "batches"
REPLAY = "replay"  # 1 if the epoch_* tensors hold the random state the current epoch started from
EPOCH_TORCH = "epoch_torch_rng"
GEN_PREFIX = "epoch_gen_"
GEN_PRESENT = "epoch_gen_present"
# Where a loader keeps the generators its sampler draws the order from: torch's DataLoader, Accelerate's
# DataLoaderShard (whose BatchSamplerShard wraps the batch sampler) and its SeedableRandomSampler.
_GENERATOR_PATHS = (
    "generator",
    "sampler.generator",
    "batch_sampler.sampler.generator",
    "batch_sampler.batch_sampler.sampler.generator",
    "base_dataloader.generator",
    "base_dataloader.sampler.generator",
)


class ReplayLoader:
    """Wraps a DataLoader (or anything with ``__iter__``/``__len__``); iterate it once per epoch.

    Put it in ``TrainState(dataloader=...)``. The first iteration after a restore continues the saved epoch
    at the next unconsumed batch; a batch counts as consumed once it is handed out (a save comes after the
    step that trains on it). Exact when the data's randomness comes from the
    sampler's generators, the torch RNG at the start of the iteration, or worker processes seeded from it
    (not with ``persistent_workers=True``, whose workers carry their RNG across epochs).
    """

    def __init__(self, loader: Any) -> None:
        if not hasattr(loader, "__iter__"):
            raise ValueError(f"ReplayLoader needs an iterable loader, got {type(loader).__name__}")
        if getattr(loader, "persistent_workers", False):
            raise ValueError(
                "ReplayLoader: persistent_workers=True keeps each worker's RNG across epochs, so an epoch "
                "cannot be replayed as it first ran; build the DataLoader with persistent_workers=False"
            )
        self.loader = loader
        self.epoch = 0
        self.batches = 0  # consumed in self.epoch
        self._finished = False  # the iteration of self.epoch ran to its end
        self._started = False  # an iteration of self.epoch has begun
        self._epoch_rng: dict[str, torch.Tensor] | None = None

    # ---- what frameworks look for on a DataLoader -----------------------------------------------------

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the epoch is counted here (a framework's count restarts at 0 after a resume)."""

    # ---- iteration -------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        if self._started:  # every iteration after the first of an epoch is the next epoch
            self._next_epoch()
        skip, replay = self.batches, self._epoch_rng
        if replay is None or skip == 0:
            skip, replay = 0, None
        self._started = True
        self.batches = 0
        self._finished = False
        return self._iterate(skip, replay)

    def _iterate(self, skip: int, replay: dict[str, torch.Tensor] | None) -> Iterator[Any]:
        self._set_loader_epoch()
        if replay is None:
            # Taken here, at the first next(): the loader draws its order and worker seeds right after.
            self._epoch_rng = self._random_state()
            it = iter(self.loader)
        else:
            resumed = self._random_state()  # the training RNG the restore put back
            self._set_random_state(replay)
            it = iter(self.loader)
            for _ in range(skip):
                # Loaded and dropped: the same workers load the same batches with the same seeds as before.
                if next(it, _END) is _END:
                    raise ValueError(
                        f"ReplayLoader: the checkpoint consumed {skip} batches of epoch {self.epoch}, but "
                        "the loader has fewer now (a different dataset or batch size?)"
                    )
                self.batches += 1
            # The training RNG goes back to the restored one. The sampler's generators do not: they stay
            # where drawing this epoch's order left them, as in the uninterrupted run, because the next
            # epoch's order is drawn from them (Accelerate's multi-process loaders shuffle with a generator of
            # their own, synchronised from rank 0 at each epoch's start).
            torch.set_rng_state(resumed[EPOCH_TORCH].contiguous())
        for batch in it:
            self.batches += 1  # handed out = consumed: a save comes after the step that trains on it
            yield batch
        self._finished = True

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.batches = 0
        self._epoch_rng = None
        self._finished = False
        self._started = False

    def _set_loader_epoch(self) -> None:
        if hasattr(self.loader, "set_epoch"):
            self.loader.set_epoch(self.epoch)
        # A batch sampler wrapped by Accelerate's BatchSamplerShard is not reached by the loader's set_epoch.
        inner: Any = getattr(getattr(self.loader, "batch_sampler", None), "batch_sampler", None)
        if hasattr(inner, "set_epoch"):
            inner.set_epoch(self.epoch)

    # ---- random state ----------------------------------------------------------------------------------

    def _generators(self) -> list[torch.Generator | None]:
        """The CPU generator at each of ``_GENERATOR_PATHS`` (None where there is none, or none yet: a
        sampler may create its generator when first iterated)."""
        found: list[torch.Generator | None] = []
        for path in _GENERATOR_PATHS:
            obj: Any = self.loader
            for part in path.split("."):
                obj = getattr(obj, part, None)
            found.append(obj if isinstance(obj, torch.Generator) and obj.device.type == "cpu" else None)
        return found

    def _random_state(self) -> dict[str, torch.Tensor]:
        """Fixed keys and shapes (a restore loads into them): one slot per path, zeros where absent."""
        torch_state = torch.get_rng_state()
        state = {EPOCH_TORCH: torch_state}
        present = []
        for i, gen in enumerate(self._generators()):
            value = gen.get_state() if gen is not None else torch.zeros_like(torch_state)
            present.append(gen is not None and value.shape == torch_state.shape)
            state[f"{GEN_PREFIX}{i}"] = value if present[-1] else torch.zeros_like(torch_state)
        state[GEN_PRESENT] = torch.tensor(present, dtype=torch.uint8)
        return state

    def _set_random_state(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state[EPOCH_TORCH].contiguous())
        for i, gen in enumerate(self._generators()):
            if gen is not None and bool(state[GEN_PRESENT][i]):
                gen.set_state(state[f"{GEN_PREFIX}{i}"].contiguous())

    # ---- Stateful --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The same keys and shapes whatever the position (a restore loads into this as a template)."""
        epoch, batches, rng = self.epoch, self.batches, self._epoch_rng
        if self._finished or (self._started and _known_len(self.loader) == batches):
            # The epoch is done: the next one starts from the RNG as it is then, not from a replay.
            epoch, batches, rng = epoch + 1, 0, None
        replay = rng is not None and batches > 0
        out: dict[str, Any] = {EPOCH: epoch, BATCHES: batches, REPLAY: int(replay)}
        out.update(rng if replay and rng is not None else self._random_state())
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        epoch, batches = int(state_dict[EPOCH]), int(state_dict[BATCHES])
        if epoch < 0 or batches < 0:
            raise ValueError(f"ReplayLoader: invalid saved position epoch={epoch}, batches={batches}")
        expected = set(self._random_state())
        saved = {k for k in state_dict if k == EPOCH_TORCH or k.startswith(GEN_PREFIX)}
        if saved != expected:
            raise ValueError(
                f"ReplayLoader: the checkpoint holds random state {sorted(saved)}, this loader uses "
                f"{sorted(expected)} (a different sampler?)"
            )
        replay = bool(int(state_dict[REPLAY]))
        if batches > 0 and not replay:
            raise ValueError(
                f"ReplayLoader: saved position {batches} in epoch {epoch} lacks its random state"
            )
        self.epoch, self.batches = epoch, batches
        self._epoch_rng = {k: state_dict[k].clone() for k in expected} if replay else None
        self._started = False
        self._finished = False


_END = object()


def _known_len(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None
