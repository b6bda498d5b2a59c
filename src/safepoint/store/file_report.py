"""Each rank's written files (size, crc32c) ride to rank 0 on DCP's own write collective.

DCP gathers every rank's write results on the coordinator, for ``finish`` (the ``.metadata`` write). A
rank's file list travels with them as one more ``WriteResult`` under a reserved index, and ``finish`` takes
it out before DCP sees the results, so ``.metadata`` is exactly what plain DCP writes. The commit then
needs no gather of its own: a save runs DCP's collectives and one broadcast of the outcome (issue 15,
item 4; counted in tests/dist/test_collectives.py).
"""

from __future__ import annotations

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

FILES_INDEX = MetadataIndex(fqn="__safepoint_written_files__")
"""The reserved index of the extra write result; no state dict key can take it (DCP keys are dotted
paths of the state dict, and safepoint's sections never start with an underscore)."""

Files = dict[str, tuple[int, str]]


def with_files(fut: Future[list[WriteResult]], files: Files, skipped: int = 0) -> Future[list[WriteResult]]:
    """``fut``'s results (a finished write) plus this rank's file list; ``skipped``: the bytes of those
    files that were linked from an older step rather than written (incremental saves), in the report's
    ``size_in_bytes``."""
    report = WriteResult(index=FILES_INDEX, size_in_bytes=skipped, storage_data=dict(files))
    out: Future[list[WriteResult]] = Future()
    out.set_result([*fut.wait(), report])
    return out


def skipped_per_rank(results: list[list[WriteResult]]) -> list[int]:
    """Each rank's bytes linked rather than written (``with_files``' ``skipped``), in rank order."""
    return [sum(wr.size_in_bytes for wr in rank if _is_report(wr)) for rank in results]


def _is_report(wr: WriteResult) -> bool:
    """``wr.index == FILES_INDEX``, its name compared first: the dataclass's ``__eq__`` builds two tuples
    per call (~0.4 us), and ``finish`` asks this of every item's result twice per save."""
    return wr.index.fqn == FILES_INDEX.fqn and wr.index == FILES_INDEX


def split_files(results: list[list[WriteResult]]) -> tuple[list[Files], list[list[WriteResult]]]:
    """(each rank's file list, in rank order; the write results without them), on the coordinator."""
    per_rank: list[Files] = []
    clean: list[list[WriteResult]] = []
    for rank_results in results:
        files: Files = {}
        kept = []
        for wr in rank_results:
            if _is_report(wr):
                files.update(wr.storage_data)
            else:
                kept.append(wr)
        per_rank.append(files)
        clean.append(kept)
    return per_rank, clean
