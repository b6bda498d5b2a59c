"""The storage writer of async saves with a writer process: DCP's planning and ``finish`` run in the rank's
background thread as for any save; ``write_data`` hands the rank's items to the writer process
(writer_process.py) and turns its answer back into DCP's write results and safepoint's file report.

Incremental saves (store/incremental.py) are arranged here, in the rank's background thread: the staged
copies are fingerprinted, unchanged stable groups hard-linked from the previous step (through RootDir), and
only the files left to write go to the process, each with its name and items. Why the rank and not the
process: the history of committed saves lives with the rank (a writer process killed and restarted loses
nothing of it), the links need the rank's guarded walk of the root, and the fingerprints read the same
shared staging memory the process would (the writer thread pays the same cost).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from safepoint.save.handoff import Describer
from safepoint.save.shared_buffers import SharedArena
from safepoint.save.writer_process import (
    WriterProcess,
    WriterProcessError,
    WriterStarting,
    WriterUnavailable,
)
from safepoint.store.crc_switch import torch_crc32_off
from safepoint.store.file_report import with_files
from safepoint.store.storage import SafepointWriter

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
        describer: Describer | None = None,
    ) -> None:
        super().__init__(path, thread_count=thread_count)
        self._process, self._arena = process, arena
        # One per manager (process_writer_factory): a steady save reuses the last save's places.
        self._describer = describer if describer is not None else Describer()
        self._plan: SavePlan | None = None  # this save's plan (incremental: the arranged files refer to it)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self.incremental is not None:
            # Arranged by SafepointWriter (fingerprints, links); the files left go through _write_entries.
            self._plan = plan
            return super().write_data(plan, planner)
        # Byte items are torch.save'd as they are resolved, here: with torch's CRC-32 off, as the thread
        # writer resolves them, so both write the same bytes (crc32c covers them either way).
        with torch_crc32_off():
            places, values = self._describer.describe(plan, planner, self._arena)
        try:
            results, files = self._process.write(
                self._arena, str(self.path), self.thread_count, plan, places, values
            )
        except WriterStarting:
            log.info("safepoint: %s written by the thread: the writer process is still starting", self.path)
            return super().write_data(plan, planner)
        except WriterUnavailable:
            return super().write_data(plan, planner)  # "auto" without a process: this thread writes
        if not self._describer.checked_before(plan, None, results):
            if len(results) != len(plan.items) or {r.index for r in results} != {i.index for i in plan.items}:
                raise WriterProcessError(
                    f"the writer process answered for {len(results)} items, not the {len(plan.items)} planned"
                )
            self._describer.check_passed(plan, None, results)
        self.pause()  # the reply came: the rest (results, .metadata, commit) is this process's Python work
        for name, (size, crc) in files.items():
            self.recorder.record(name, size, crc)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return with_files(fut, self.written_files())

    def _write_entries(self, planner: SavePlanner, entries: list[Any]) -> list[WriteResult]:
        """The process writes the arranged files (names and items as ``entries`` say); the rank keeps the
        whole plan's description (handoff.py: an unchanged state sends only its values) and names, per
        file, the positions of its items in the plan."""
        plan = self._plan
        assert plan is not None
        places, values = self._describer.describe(plan, planner, self._arena)
        files = [(name, self._describer.positions(plan, items)) for _, name, items in entries]
        try:
            results, written = self._process.write(
                self._arena, str(self.path), self.thread_count, plan, places, values, files
            )
        except WriterStarting:
            log.info("safepoint: %s written by the thread: the writer process is still starting", self.path)
            return super()._write_entries(planner, entries)
        except WriterUnavailable:
            return super()._write_entries(planner, entries)
        self.pause()  # as in write_data
        if not self._describer.checked_before(plan, files, results):
            wanted = {item.index for _, _, items in entries for item in items}
            if len(results) != len(wanted) or {r.index for r in results} != wanted:
                raise WriterProcessError(
                    f"the writer process answered for {len(results)} items, not the {len(wanted)} arranged"
                )
            self._describer.check_passed(plan, files, results)
        for name, (size, crc) in written.items():
            self.recorder.record(name, size, crc)
        # A copy: the list may be the one the rank keeps for the process's "same" answers (handoff.Sent),
        # and the caller adds the linked and aliased items to what it gets.
        return list(results)


def process_writer_factory(
    process: WriterProcess, arena: Callable[[], SharedArena | None]
) -> Callable[[SafepointWriter], ProcessWriter]:
    """For SyncSaver: each save's storage writer, with its writes going to ``process``; ``arena`` gives the
    staging segment of the state being saved (one save in flight, so it cannot change during the save)."""

    describer = Describer()  # the last save's places, for the next save of the same plan and segment

    def wrap(writer: SafepointWriter) -> ProcessWriter:
        return ProcessWriter(
            writer.path, thread_count=writer.thread_count, process=process, arena=arena(), describer=describer
        )

    return wrap
