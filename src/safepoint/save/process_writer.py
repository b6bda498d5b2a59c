"""The storage writer of async saves with a writer process: DCP's planning and ``finish`` run in the rank's
background thread as for any save; ``write_data`` hands the rank's items to the writer process
(writer_process.py) and turns its answer back into DCP's write results and safepoint's file report.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from safepoint.save.handoff import describe
from safepoint.save.shared_buffers import SharedArena
from safepoint.save.writer_process import (
    WriterProcess,
    WriterProcessError,
    WriterStarting,
    WriterUnavailable,
)
from safepoint.store.file_report import with_files
from safepoint.store.storage import SafepointWriter, torch_crc32_off

log = logging.getLogger("safepoint")


class ProcessWriter(SafepointWriter):
    """SafepointWriter whose ``write_data`` runs in the writer process; planning and ``finish`` stay here."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        thread_count: int,
        process: WriterProcess,
        arena: SharedArena | None,
    ) -> None:
        super().__init__(path, thread_count=thread_count)
        self._process, self._arena = process, arena

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        # Byte items are torch.save'd as they are resolved, here: with torch's CRC-32 off, as the thread
        # writer resolves them, so both write the same bytes (crc32c covers them either way).
        with torch_crc32_off():
            places, values = describe(plan, planner, self._arena)
        try:
            results, files = self._process.write(
                self._arena, str(self.path), self.thread_count, plan, places, values
            )
        except WriterStarting:
            log.info("safepoint: %s written by the thread: the writer process is still starting", self.path)
            return super().write_data(plan, planner)
        except WriterUnavailable:
            return super().write_data(plan, planner)  # "auto" without a process: this thread writes
        if len(results) != len(plan.items) or {r.index for r in results} != {i.index for i in plan.items}:
            raise WriterProcessError(
                f"the writer process answered for {len(results)} items, not the {len(plan.items)} planned"
            )
        for name, (size, crc) in files.items():
            self.recorder.record(name, size, crc)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return with_files(fut, self.written_files())


def process_writer_factory(
    process: WriterProcess, arena: Callable[[], SharedArena | None]
) -> Callable[[SafepointWriter], ProcessWriter]:
    """For SyncSaver: each save's storage writer, with its writes going to ``process``; ``arena`` gives the
    staging segment of the state being saved (one save in flight, so it cannot change during the save)."""

    def wrap(writer: SafepointWriter) -> ProcessWriter:
        return ProcessWriter(writer.path, thread_count=writer.thread_count, process=process, arena=arena())

    return wrap
