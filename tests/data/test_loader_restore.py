"""Restoring a data position leaves the loader's generator where the uninterrupted run has it.

torchdata's ``StatefulDataLoader.state_dict()`` on a loader with no iterator makes one, which draws a base
seed from the loader's ``generator=`` (and forks its workers). The restore used to call it on the fresh loader
to shape the load, so a run resumed mid-epoch drew one seed more than the uninterrupted run: from the next
epoch on, its workers got other seeds (their random augmentations differed). Found by
tests/gpu/test_cuda.py's FSDP2 run, which compares every saved key; reproduced here on CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import safepoint

DATA = list(range(24))  # 6 batches of 4 per epoch


def loader() -> StatefulDataLoader:
    # In order (shuffle=False): torchdata's own RandomSampler draws its permutation from this generator too
    # and does not resume it bitwise into the next epoch, with or without safepoint (the template and the
    # docs shuffle with safepoint.ResumableSampler, which has its own seed).
    return StatefulDataLoader(DATA, batch_size=4, generator=torch.Generator().manual_seed(3))


def epoch_seeds(dl: StatefulDataLoader, epochs: int) -> list[tuple[int, list[list[int]]]]:
    """Each epoch's iterator base seed (what seeds the workers) and its batches."""
    out = []
    for _ in range(epochs):
        it = iter(dl)
        out.append((it._base_seed, [b.tolist() for b in it]))
    return out


def test_a_mid_epoch_resume_draws_the_same_worker_seeds_as_the_uninterrupted_run(root: Path) -> None:
    expected = epoch_seeds(loader(), 3)
    first = loader()
    it = iter(first)
    seen = [next(it).tolist() for _ in range(2)]  # two batches into epoch 1
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(2, safepoint.TrainState(dataloader=first, rng=False))
    resumed = loader()
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(dataloader=resumed, rng=False)) == 2
    rest = [b.tolist() for b in resumed]  # the rest of epoch 1
    assert seen + rest == expected[0][1]
    assert epoch_seeds(resumed, 2) == expected[1:]
