"""Fixtures for the save tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from safepoint.save import gather
from safepoint.save.staging import Stager


@pytest.fixture()
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A real gloo process group of world size 1 in this process (DTensors need one)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(params=[False, True], ids=["thread", "process"])
def stager(request: pytest.FixtureRequest) -> Iterator[Stager]:
    """A Stager for each writer: the thread's private buffers, and the process's shared segment (Linux)."""
    if request.param and not hasattr(os, "memfd_create"):
        pytest.skip("shared staging is Linux-only")
    s = Stager(shared=request.param)
    yield s
    s.release()


@pytest.fixture()
def gather_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Async staging gathers small CPU tensors as it does CUDA ones (save/gather.py): its path, run here."""
    monkeypatch.setattr(gather, "GATHER_DEVICE_TYPES", frozenset({"cpu", "cuda"}))
