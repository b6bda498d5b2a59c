"""A path (or ``file://``) durable root behind a ``local_root``: a network file system behind a local disk,
served by fsspec's local file system, which creates no parent directory for a write or a copy. Every object
write of safepoint's must make the directory it writes into, as an object store needs none."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import safepoint


def test_an_unchanged_tensor_is_copied_into_a_new_step_without_a_failed_copy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # An incremental save copies an unchanged group server-side into step-N/; when that copy came before
    # any upload into step-N/, the directory did not exist, the copy failed with FileNotFoundError and the
    # file was uploaded again, with a WARNING at every such save.
    durable = tmp_path / "durable"
    model = torch.nn.Linear(64, 64)
    state = safepoint.TrainState(model=model, rng=False)
    with caplog.at_level(logging.WARNING, logger="safepoint"):
        with safepoint.CheckpointManager(durable, local_root=tmp_path / "local") as mgr:
            for step in (1, 2, 3):
                mgr.save(step, state)
            mgr.wait()
    assert not [r.getMessage() for r in caplog.records if "server-side copy" in r.getMessage()]
    with safepoint.CheckpointManager(durable) as mgr:
        assert [c.step for c in mgr.list()] == [1, 2, 3]
        fresh = torch.nn.Linear(64, 64)
        assert mgr.restore(safepoint.TrainState(model=fresh, rng=False), step=3) == 3
    assert torch.equal(fresh.weight, model.weight)
