"""The file list that rides on DCP's write results (store/file_report.py): found by value, as a pickled
copy arrives from another rank, and never confused with an item's result."""

from __future__ import annotations

import pickle

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from safepoint.store.file_report import FILES_INDEX, skipped_per_rank, split_files, with_files


def _item(fqn: str, offset: tuple[int, ...] | None = None) -> WriteResult:
    return WriteResult(index=MetadataIndex(fqn=fqn, offset=offset), size_in_bytes=4, storage_data="x")


def test_the_report_is_found_by_value_and_items_are_kept() -> None:
    done: Future[list[WriteResult]] = Future()
    done.set_result([_item("model.w"), _item(FILES_INDEX.fqn, (0,))])  # same name, another index: an item
    mine = with_files(done, {"__0_0.distcp": (10, "00000000")}, skipped=7).wait()
    theirs = pickle.loads(pickle.dumps(with_files(done, {"__1_0.distcp": (3, "ffffffff")}, skipped=2).wait()))
    assert theirs[-1].index is not FILES_INDEX and theirs[-1].index == FILES_INDEX
    files, clean = split_files([mine, theirs])
    assert files == [{"__0_0.distcp": (10, "00000000")}, {"__1_0.distcp": (3, "ffffffff")}]
    assert [[wr.index.fqn for wr in rank] for rank in clean] == [["model.w", FILES_INDEX.fqn]] * 2
    assert skipped_per_rank([mine, theirs]) == [7, 2]
