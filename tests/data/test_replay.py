"""ReplayLoader: a resumed epoch hands out exactly the batches an uninterrupted run gets, worker
augmentations included, whatever the shuffle's and the workers' seeds were drawn from."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from safepoint.data.replay import ReplayLoader

N, BATCH = 24, 4  # 6 batches an epoch


class Noisy(Dataset[torch.Tensor]):
    """Each sample carries a number drawn in the worker: it depends on the worker's seed."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, int(torch.randint(0, 10**6, ()))])


def loader(**kw: Any) -> DataLoader[torch.Tensor]:
    return DataLoader(Noisy(), batch_size=BATCH, shuffle=True, num_workers=2, **kw)


def train(data: Any, epochs: int, save_after: int | None = None) -> tuple[list[torch.Tensor], Any]:
    """Iterate ``epochs`` passes, drawing from the torch RNG after each batch as a dropout layer does."""
    seen: list[torch.Tensor] = []
    saved = None
    for _ in range(epochs):
        for batch in data:
            seen.append(batch)
            torch.rand(3)
            if len(seen) == save_after:
                saved = (data.state_dict(), torch.get_rng_state())
    return seen, saved


@pytest.mark.parametrize("save_after", [8, 6])  # mid-epoch 1; the last batch of epoch 0
def test_a_resumed_epoch_replays_the_uninterrupted_batches(save_after: int) -> None:
    torch.manual_seed(0)
    reference, saved = train(ReplayLoader(loader()), epochs=3, save_after=save_after)
    assert saved is not None
    torch.manual_seed(1234)  # a restarted process starts from other random state
    resumed = ReplayLoader(loader())
    resumed.load_state_dict(saved[0])
    torch.set_rng_state(saved[1])  # what TrainState(rng=True) restores
    epochs_left = 3 - save_after // 6
    rest, _ = train(resumed, epochs=epochs_left)
    assert len(rest) == len(reference) - save_after
    assert all(torch.equal(a, b) for a, b in zip(rest, reference[save_after:], strict=True))


def test_skipping_batches_on_a_new_iterator_changes_the_data() -> None:
    """What a resume without the replay does (restore the RNG, skip the consumed batches): other data."""
    torch.manual_seed(0)
    reference, saved = train(ReplayLoader(loader()), epochs=2, save_after=8)
    assert saved is not None
    torch.set_rng_state(saved[1])
    skipped = list(itertools.islice(iter(loader()), 2, None))
    assert not all(torch.equal(a, b) for a, b in zip(skipped, reference[8:], strict=True))


def test_refuses_what_it_cannot_replay() -> None:
    with pytest.raises(ValueError, match="persistent_workers=True"):
        ReplayLoader(loader(persistent_workers=True))
    state = ReplayLoader(loader()).state_dict()
    with pytest.raises(ValueError, match="lacks its random state"):
        ReplayLoader(loader()).load_state_dict({**state, "batches": 3, "replay": 0})
    with pytest.raises(ValueError, match="invalid saved position"):
        ReplayLoader(loader()).load_state_dict({**state, "epoch": -1})
    too_far = ReplayLoader(DataLoader(Noisy(), batch_size=BATCH))
    too_far.load_state_dict({**state, "batches": 9, "replay": 1})
    with pytest.raises(ValueError, match="consumed 9 batches"):
        list(too_far)
