"""safepoint writes DCP items from per-shape templates instead of torch.save per item (store/item_writer.py):
the files must hold exactly the bytes DCP's own writer would put there, and load with plain dcp.load."""

from __future__ import annotations

import io
import pickle
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import safepoint
from safepoint.store import item_writer
from safepoint.store.crc_switch import torch_crc32_off
from safepoint.store.storage import SafepointWriter


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(600, 600, generator=g)  # over the batch buffer's direct-write threshold
    return {
        "f32": torch.randn(33, 7, generator=g),
        "f32_again": torch.randn(33, 7, generator=g),  # the same template, other data
        "bf16": torch.randn(5, 9, generator=g).to(torch.bfloat16),
        "f16_nan": torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.float16),
        "i64_scalar": torch.tensor(123456789012, dtype=torch.int64),
        "bool": torch.rand(17, generator=g) > 0.5,
        "u8": torch.randint(0, 255, (3, 4, 5), dtype=torch.uint8, generator=g),
        "c64": torch.randn(4, dtype=torch.complex64, generator=g),
        "noncontig": torch.randn(8, 6, generator=g).t(),  # torch.save itself (no template)
        "slice": torch.randn(100, generator=g)[10:20],  # cloned to a minimal storage, as DCP does
        "empty": torch.empty(0, 3),
        "big": big,
        "param": nn.Parameter(torch.randn(4, 4, generator=g)),
        "extra": {"step": 7, "name": "x", "nested": [1, 2.5]},  # byte items
    }


def _items(path: Path) -> dict[str, bytes]:
    """{fqn: the item's bytes in its .distcp file}."""
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    out = {}
    for index, info in md.storage_data.items():
        with open(path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            out[index.fqn] = f.read(info.length)
    return out


def _dcp_save(state: dict[str, object], path: Path) -> None:
    dcp.save(state, storage_writer=SafepointWriter(path), no_dist=True)


def _plain_dcp_save(state: dict[str, object], path: Path) -> None:
    writer = dcp.FileSystemWriter(path, single_file_per_rank=True, sync_files=True, thread_count=1)
    with torch_crc32_off():  # what safepoint's writes run under
        dcp.save(state, storage_writer=writer, no_dist=True)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.contiguous().view(-1).view(torch.uint8).equal(b.contiguous().view(-1).view(torch.uint8))


def test_files_hold_the_bytes_dcps_own_writer_writes(tmp_path: Path) -> None:
    state = _state()
    _dcp_save(state, tmp_path / "ours")
    _plain_dcp_save(state, tmp_path / "dcp")
    ours, theirs = _items(tmp_path / "ours"), _items(tmp_path / "dcp")
    assert ours.keys() == theirs.keys()
    for fqn in theirs:
        assert ours[fqn] == theirs[fqn], fqn
    dcp_file = next((tmp_path / "dcp").glob("*.distcp")).read_bytes()
    assert next((tmp_path / "ours").glob("*.distcp")).read_bytes() == dcp_file


def test_plain_dcp_load_reads_every_tensor_bitwise(tmp_path: Path) -> None:
    state = _state()
    _dcp_save(state, tmp_path / "ck")
    target: dict[str, object] = {
        k: torch.zeros_like(v.detach()) if isinstance(v, torch.Tensor) else {} for k, v in state.items()
    }
    target["extra"] = {"step": 0, "name": "", "nested": [0, 0.0]}
    dcp.load(target, storage_reader=dcp.FileSystemReader(tmp_path / "ck"), no_dist=True)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert _same_bits(target[k], v.detach()), k  # type: ignore[arg-type]
    assert target["extra"] == state["extra"]


def test_each_tensor_item_is_a_torch_load_able_zip(tmp_path: Path) -> None:
    state = _state()
    _dcp_save(state, tmp_path / "ck")
    items = _items(tmp_path / "ck")
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            loaded = torch.load(io.BytesIO(items[k]), weights_only=True)
            assert _same_bits(loaded, v.detach()), k


def test_no_template_while_torch_writes_crc32(tmp_path: Path) -> None:
    # With torch's CRC-32 on, a record's header depends on its data: a template would be wrong.
    t = torch.randn(3, 3)
    assert torch.serialization.get_crc32_options()
    assert item_writer.template_for(t) is None
    with torch_crc32_off():
        assert item_writer.template_for(t) is not None


def test_checkpoint_of_a_real_model_is_verified_and_restored(tmp_path: Path) -> None:
    model = nn.Sequential(*[nn.Linear(13, 13) for _ in range(20)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 13)).sum().backward()
    opt.step()
    fresh = nn.Sequential(*[nn.Linear(13, 13) for _ in range(20)])
    fresh_opt = torch.optim.Adam(fresh.parameters())
    with safepoint.CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(1, safepoint.TrainState(model=model, optimizer=opt))
        mgr.layout.verify(1)  # size and crc32c of every file, as written
        mgr.restore(safepoint.TrainState(model=fresh, optimizer=fresh_opt))
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert _same_bits(a.detach(), b.detach())
    for sa, sb in zip(opt.state.values(), fresh_opt.state.values(), strict=True):
        assert _same_bits(sa["exp_avg_sq"], sb["exp_avg_sq"])


@pytest.mark.parametrize("threads", [2, 4])
def test_writer_threads_write_the_same_items(tmp_path: Path, threads: int) -> None:
    # The reference is DCP on one thread: torch 2.13's CRC-32 switch is per thread, so DCP's own extra
    # threads write with CRC-32 on whatever the calling thread set. Each of ours turns it off itself: the
    # items are the same bytes whichever thread wrote them (before, an extra thread that got a file wrote
    # it with CRC-32 on, which failed this test now and then).
    state = _state()
    dcp.save(state, storage_writer=SafepointWriter(tmp_path / "ours", thread_count=threads), no_dist=True)
    writer = dcp.FileSystemWriter(tmp_path / "dcp", single_file_per_rank=True, thread_count=1)
    with torch_crc32_off():
        dcp.save(state, storage_writer=writer, no_dist=True)
    assert _items(tmp_path / "ours") == _items(tmp_path / "dcp")


def test_the_crc32_switch_holds_in_every_writer_thread() -> None:
    # A writer thread that enters the switch while another thread holds it gets CRC-32 off too, with a
    # per-thread setting (torch 2.13) as with a process-wide one; leaving puts its own setting back.
    seen: list[bool] = []

    def writer_thread() -> None:
        with torch_crc32_off():
            seen.append(torch.serialization.get_crc32_options())

    with torch_crc32_off():
        t = threading.Thread(target=writer_thread)
        t.start()
        t.join()
        assert not torch.serialization.get_crc32_options()
    assert seen == [False]
    assert torch.serialization.get_crc32_options()


def test_big_tensors_are_written_by_torch_save_itself() -> None:
    # A template of a big tensor would cost two torch.saves of it to make; its fixed cost is noise anyway.
    with torch_crc32_off():
        assert item_writer.template_for(torch.zeros(1024 * 1024 // 4)) is not None
        assert item_writer.template_for(torch.zeros(1024 * 1024 // 4 + 1)) is None


def test_a_changed_state_is_planned_afresh(tmp_path: Path) -> None:
    # Saves reuse DCP's cached plan while the state keeps its shape; a new shape must not reuse it.
    small, big, fresh, again = nn.Linear(4, 4), nn.Linear(5, 6), nn.Linear(5, 6), nn.Linear(4, 4)
    with safepoint.CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(1, safepoint.TrainState(model=small, rng=False))
        mgr.save(2, safepoint.TrainState(model=small, rng=False))
        mgr.save(3, safepoint.TrainState(model=big, rng=False))
        assert mgr.restore(safepoint.TrainState(model=fresh, rng=False)) == 3
        assert mgr.restore(safepoint.TrainState(model=again, rng=False), step=2) == 2
    assert _same_bits(fresh.weight.detach(), big.weight.detach())
    assert _same_bits(again.weight.detach(), small.weight.detach())
