"""A rank file's bytes come from a per-structure template (store/rank_bytes.py): always what torch.save
writes (CRC-32 off), checked; anything but plain tensors in dicts goes through torch.save itself."""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import safepoint
from safepoint.data import rng
from safepoint.store import rank_bytes
from safepoint.store.crc_switch import torch_crc32_off


def _torch_save(payload: Any) -> bytes:
    with torch_crc32_off():
        buf = io.BytesIO()
        torch.save(payload, buf)
        return buf.getvalue()


@pytest.fixture
def saves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many torch.saves rank_bytes ran."""
    calls: list[int] = []
    real = rank_bytes._saved

    def counting(payload: Any) -> bytes:
        calls.append(1)
        return real(payload)

    monkeypatch.setattr(rank_bytes, "_saved", counting)
    monkeypatch.setattr(rank_bytes, "_templates", {})
    return calls


def test_the_rng_states_are_torch_save_s_bytes_from_one_template(saves: list[int]) -> None:
    for seed in range(4):
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        random.gauss(0, 1)  # a cached gauss on some rounds, none on others: the same structure
        payload = {"rng": rng.capture_rng(), "more": {"x": torch.arange(seed + 3.0)[:3].clone()}}
        made = rank_bytes.saved_bytes(payload)
        assert made == _torch_save(payload)
        loaded = torch.load(io.BytesIO(made), weights_only=True)
        assert torch.equal(loaded["more"]["x"], payload["more"]["x"])
        assert torch.equal(loaded["rng"]["torch_cpu"], payload["rng"]["torch_cpu"])
    assert len(saves) == 2  # the template and its check, once: then no torch.save at all


@pytest.mark.parametrize(
    "payload",
    [
        {"dataloader": {"epoch": 3, "pos": torch.tensor([1, 2])}},  # a non-tensor value
        {"rng": {"a": torch.arange(8)[2:]}},  # a view into a larger storage
        {"rng": {"a": torch.zeros(2, 3).t()}},  # not contiguous
        {"rng": {"a": (t := torch.zeros(4)), "b": t}},  # two names, one tensor
    ],
)
def test_anything_else_is_torch_save_itself(payload: dict[str, Any], saves: list[int]) -> None:
    for _ in range(2):
        assert rank_bytes.saved_bytes(payload) == _torch_save(payload)
    assert len(saves) == 2 and rank_bytes._templates == {}


def test_rng_restored_exactly_through_the_rank_file(root: Path) -> None:
    model = torch.nn.Linear(4, 4)
    with safepoint.CheckpointManager(root) as mgr:
        for step in (1, 2):
            random.random()
            torch.rand(2)
            mgr.save(step, safepoint.TrainState(model=model))
        expected = (random.random(), float(np.random.rand()), torch.rand(3))
    with safepoint.CheckpointManager(root) as mgr:
        random.seed(99)
        torch.manual_seed(99)
        assert mgr.restore(safepoint.TrainState(model=model)) == 2
        got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_a_template_made_with_crc32_off_is_not_used_with_it_on(
    saves: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from safepoint.store import crc_switch

    payload = {"rng": {"a": torch.arange(6.0), "b": torch.ones(3, dtype=torch.int64)}}
    assert rank_bytes.saved_bytes(payload) == _torch_save(payload)  # a template, CRC-32 off
    monkeypatch.setattr(crc_switch, "SKIP_TORCH_CRC32", False)  # the user keeps torch's CRC-32
    payload["rng"]["a"].add_(1.0)
    buf = io.BytesIO()
    torch.save(payload, buf)
    assert rank_bytes.saved_bytes(payload) == buf.getvalue()  # torch.save itself: the CRCs depend on data


def _with_attribute() -> torch.Tensor:
    t = torch.tensor([1, 2])
    t.tag = "kept"  # type: ignore[attr-defined]
    return t


@pytest.mark.parametrize(
    ("first", "then"),
    [
        (torch.tensor([1 + 2j, 3 - 4j]), torch.tensor([1 + 2j, 3 - 4j]).conj()),  # conj bit: pickled
        (torch.tensor([1.0, 2.0]), torch._neg_view(torch.tensor([1.0, 2.0]))),  # neg bit: pickled
        (torch.tensor([1, 2]), _with_attribute()),  # Python attributes: pickled with the tensor
        (
            torch.quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.1, 0, torch.qint8),
            torch.quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.5, 3, torch.qint8),
        ),  # scale and zero point: pickled
    ],
)
def test_what_the_structure_key_does_not_hold_goes_through_torch_save(
    first: torch.Tensor, then: torch.Tensor, saves: list[int]
) -> None:
    # Review round 5: a conj or neg view (an ``extra`` value) failed the save (``.view(uint8)`` refuses
    # them), and a tensor with an attribute was written from the template of one without (attribute lost).
    for value in (first, then):
        payload = {"extra": {"v": value}}
        made = rank_bytes.saved_bytes(payload)
        assert made == _torch_save(payload)
        loaded = torch.load(io.BytesIO(made), weights_only=True)["extra"]["v"]
        assert torch.equal(loaded, value) and loaded.__dict__ == value.__dict__


def test_a_conj_extra_value_saves_and_restores(root: Path) -> None:
    value = torch.tensor([1 + 2j, 3 - 4j]).conj()
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, safepoint.TrainState(model=torch.nn.Linear(2, 2), extra={"v": value}))
        state = safepoint.TrainState(
            model=torch.nn.Linear(2, 2), extra={"v": torch.zeros(2, dtype=torch.cfloat)}
        )
        mgr.restore(state)
    assert state.extra is not None and torch.equal(state.extra["v"], value)
