"""``.metadata``'s unchanged head is not pickled again at every save (store/metadata_bytes.py): the bytes
written are ``pickle.dumps(metadata)``'s at every save, the head is remembered only while provably equal
(any change of a value, a type, ``MetadataIndex.index`` or an in-place change of the planner's objects is
pickled afresh), and plain ``dcp.load`` reads what was written."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

import safepoint
from safepoint.store import metadata_bytes
from safepoint.store.metadata_bytes import MetadataPickle


def _metadata(n: int = 3) -> Metadata:
    sdm: dict[str, Any] = {}
    paths: dict[str, Any] = {}
    where: dict[Any, Any] = {}
    for i in range(n):
        size = torch.Size([4, i + 1])
        props = TensorProperties(dtype=torch.float32, requires_grad=False)
        chunk = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=size)
        sdm[f"w{i}"] = TensorStorageMetadata(properties=props, size=size, chunks=[chunk])
        paths[f"w{i}"] = ("model", f"w{i}")
        where[MetadataIndex(f"w{i}", torch.Size([0, 0]), 0)] = _StorageInfo("__0_0.distcp", 100 * i, 90)
    sdm["lr"] = BytesStorageMetadata()
    paths["lr"] = ("optimizer", "param_groups", 0, "lr")
    where[MetadataIndex("lr", None, None)] = _StorageInfo("__0_0.distcp", 1000, 12)
    return Metadata(state_dict_metadata=sdm, planner_data=paths, storage_data=where, version="1.0.0")


def _save(md: Metadata, k: int) -> Metadata:
    """What a save's finish sets on the (cached) Metadata: this save's own directory and id."""
    md.storage_meta = StorageMeta(checkpoint_id=Path(f"/ckpt/.pending/step-{k}-{k:08x}"), save_id=f"id-{k}")
    return md


def test_an_unchanged_head_is_not_pickled_again_and_the_bytes_are_pickles() -> None:
    md, cache = _metadata(), MetadataPickle()
    for k in range(5):
        _save(md, k)
        assert cache.dumps(md) == pickle.dumps(md)
        # storage_data is made afresh by every save's writer: equal values, new objects
        md.storage_data = {
            MetadataIndex(i.fqn, i.offset, i.index): _StorageInfo(s.relative_path, s.offset, s.length)
            for i, s in md.storage_data.items()
        }
    assert cache.reused == 4


def _index_moved(md: Metadata) -> None:  # MetadataIndex.__eq__ ignores index: pickled all the same
    key = next(iter(md.storage_data))
    info = md.storage_data.pop(key)
    md.storage_data[MetadataIndex(key.fqn, key.offset, 7)] = info


def _offset_moved(md: Metadata) -> None:
    key = next(iter(md.storage_data))
    md.storage_data[key] = _StorageInfo("__0_0.distcp", 5, 90)


def _renamed_file(md: Metadata) -> None:
    key = next(iter(md.storage_data))
    md.storage_data[key] = _StorageInfo("__0_1000000000000000000.distcp", 0, 90)


def _bool_for_int(md: Metadata) -> None:  # True == 1, but pickles apart: refused by type
    key = list(md.storage_data)[1]
    info = md.storage_data[key]
    md.storage_data[key] = _StorageInfo(info.relative_path, True, info.length)  # type: ignore[arg-type]
    assert md.storage_data[key] == _StorageInfo(info.relative_path, 1, info.length)


def _grad_flipped_in_place(md: Metadata) -> None:  # the very same (cached) objects, changed in place
    md.state_dict_metadata["w0"].properties.requires_grad = True  # type: ignore[union-attr]


def _tuple_for_size(md: Metadata) -> None:  # torch.Size((4, 1)) == (4, 1)
    entry = md.state_dict_metadata["w0"]
    assert isinstance(entry, TensorStorageMetadata)
    entry.size = (4, 1)  # type: ignore[assignment]


def _entry_added(md: Metadata) -> None:
    md.state_dict_metadata["extra"] = BytesStorageMetadata()
    md.planner_data["extra"] = ("extra",)
    md.storage_data[MetadataIndex("extra", None, None)] = _StorageInfo("__0_0.distcp", 2000, 3)


def _attribute_added(md: Metadata) -> None:  # pickled with the object's __dict__, unknown to its __eq__
    md.state_dict_metadata["lr"].note = "x"  # type: ignore[union-attr]


def _reordered_in_place(md: Metadata) -> None:  # equal dicts, another order: pickled in that order
    md.state_dict_metadata["w0"] = md.state_dict_metadata.pop("w0")


def _size_attribute_added(md: Metadata) -> None:  # a field of an allowed type, unknown to __eq__
    md.state_dict_metadata["w1"].more = torch.Size([1])  # type: ignore[union-attr]


def _planner_data_swapped(md: Metadata) -> None:
    md.planner_data = dict(md.planner_data)


@pytest.mark.parametrize(
    "change",
    [
        _index_moved,
        _offset_moved,
        _renamed_file,
        _bool_for_int,
        _grad_flipped_in_place,
        _tuple_for_size,
        _entry_added,
        _attribute_added,
        _reordered_in_place,
        _size_attribute_added,
        _planner_data_swapped,
    ],
)
def test_any_change_of_the_head_is_pickled_afresh(change: Any) -> None:
    md, cache = _metadata(), MetadataPickle()
    cache.dumps(_save(md, 1))
    assert cache.dumps(_save(md, 2)) == pickle.dumps(md) and cache.reused == 1  # remembered
    change(md)
    assert cache.dumps(_save(md, 3)) == pickle.dumps(md)
    assert cache.reused == 1  # not spliced: the head changed


def test_what_it_cannot_prove_it_pickles_whole() -> None:
    md, cache = _metadata(), MetadataPickle()
    md.storage_data[next(iter(md.storage_data))].transform_descriptors = ["zstd"]  # an extension's item
    for k in range(3):
        assert cache.dumps(_save(md, k)) == pickle.dumps(md)
    big, cache = _metadata(800), MetadataPickle()  # over one pickle frame (64 KiB)
    assert len(pickle.dumps(_save(big, 0))) > 64 * 1024
    for k in range(3):
        assert cache.dumps(_save(big, k)) == pickle.dumps(big)
    assert cache.reused == 0
    assert metadata_bytes._body(b"\x80\x04K\x01.", b"\x80\x04") == b"K\x01"  # a dump of one frame, no FRAME


def test_every_save_of_a_manager_writes_the_pickle_of_its_metadata(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the real save path (the planner's cached Metadata, the writer's storage_data): each save's
    ``.metadata`` is ``pickle.dumps`` of that save's Metadata, most of them spliced; dcp.load reads it."""
    checked: list[bool] = []
    real = MetadataPickle.dumps

    def dumps(self: MetadataPickle, metadata: Metadata) -> bytes:
        before = self.reused
        out = real(self, metadata)
        assert out == pickle.dumps(metadata)
        checked.append(self.reused > before)
        return out

    monkeypatch.setattr(MetadataPickle, "dumps", dumps)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    state = safepoint.TrainState(model=model, optimizer=opt)
    with safepoint.CheckpointManager(tmp_path / "root", keep=safepoint.Keep(last=2)) as mgr:
        for step in range(1, 7):
            if step == 4:  # a step that changes the tensors: other files, offsets: pickled afresh
                model(torch.randn(2, 8)).sum().backward()
                opt.step()
            mgr.save(step, state)
    assert len(checked) == 6 and checked[2] and checked[5]  # two equal saves in a row: the second spliced
    out = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(out, checkpoint_id=str(tmp_path / "root" / "step-6"), no_dist=True)
    for k, v in model.state_dict().items():
        assert torch.equal(out["model"][k], v)
