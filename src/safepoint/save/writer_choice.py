"""Which writer writes the files of async saves: the writer thread, or a writer process per rank.

``async_writer="process"`` starts the process with the manager. ``"auto"`` starts none while the state is
small: the process costs ~200 MB of private memory per rank and seconds of a core (it imports torch and
DCP), and it only pays off through the GIL share of DCP's per-item work, which a state of few items does
not have (docs/async.md, "The writer: a process (default) or a thread"). The state is judged when the
staging buffers are (re)made: its first async save, and each one after its shape changed (optimizer state
appearing after the first save), which is when its item count and bytes can change at all; a state that
keeps its shape is never measured again. Once the state is large enough, the process starts and stays.
Each rank judges its own state (pipeline stages may differ): nothing collective depends on the choice, which
only moves the rank's own file writes.

Where it starts: in ``Stager.stage``, so on the thread that calls ``save()`` (the training thread), never on
the background writer thread: the kernel's death signal (PR_SET_PDEATHSIG, writer_process.py) is tied to
the thread that started the child, and the writer thread ends after each save. No save waits for it: the
save that starts it, and those before it reports ready, are written by the thread (ProcessWriter falls
back while it starts, as during a process's start-up with ``"process"``). Its staging buffers are the
first set made in the shared segment: the set of the smaller state was dropped before (Stager._allocate),
so there are never two staged copies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from safepoint.save.process_writer import process_writer_factory
from safepoint.save.shared_buffers import SharedArena
from safepoint.save.staging import Stager
from safepoint.save.writer_process import WriterProcess
from safepoint.store.storage import SafepointWriter

log = logging.getLogger("safepoint")

AUTO_PROCESS_MIN_ITEMS = 500
"""``"auto"`` starts the writer process for a state of at least this many tensor items (parameters, optimizer
moments and steps, buffers; a DTensor or ShardedTensor counts once). What the process spares the training
loop is the GIL time of DCP's per-item work in the writer thread (a ``torch.save``, a plan entry and a write
result per tensor), so the count decides, not the bytes: few large tensors cost both writers the same
(0.994x vs 0.991x the loop's steps/s), their bytes checksummed and written with the GIL released either way.
Measured (docs/benchmarks.md, "When does "auto" start the writer process?"): at 120-128 items the thread
cost a training loop less than the process in every run, from ~500 items the process cost it less in
every run but one (at 2,040 items with no idle core), and with a core to spare, at 2,040 items, half as
much; the small state of issue 27 blocked the loop less with the thread. 500: the smallest size where the
process was measured ahead; below it, the process buys nothing for its ~200 MB and seconds of CPU."""


def process_pays_off(items: int) -> bool:
    """Whether ``"auto"`` starts the writer process for a state of ``items`` tensor items."""
    return items >= AUTO_PROCESS_MIN_ITEMS


class WriterChoice:
    """The manager's writer process (or none), for its async saves.

    ``fallback`` is options.writer_process_mode's answer: None, no writer process ever (the thread); False,
    ``"process"``: started now, and one that cannot start fails the saves; True, ``"auto"``: started by the
    first async save whose state pays for it, and one that cannot start is logged once, then the thread.
    """

    def __init__(self, fallback: bool | None) -> None:
        self.process: WriterProcess | None = None
        """The writer process, once one started (it stays until ``close``)."""
        self._auto = fallback is True
        if fallback is False:
            self.process = WriterProcess(fallback=False)
            self.process.start()  # it imports torch while training starts

    def stager(self) -> Stager:
        """The staging buffers of async saves: in a shared segment the process maps, once there is one."""
        if self._auto:
            return Stager(share_from=self._share_from, before_alloc=self._drop_arena)
        return Stager(shared=self.process is not None, before_alloc=self._drop_arena)

    def wrap(
        self, arena: Callable[[], SharedArena | None]
    ) -> Callable[[SafepointWriter], SafepointWriter] | None:
        """For SyncSaver: each async save's storage writer, through the process once there is one (None:
        there never will be). ``arena`` gives the staging segment of the state being saved."""
        if self.process is None and not self._auto:
            return None

        def wrap(writer: SafepointWriter) -> SafepointWriter:
            process = self.process  # set by the training thread before this save was submitted
            return writer if process is None else process_writer_factory(process, arena)(writer)

        return wrap

    def _share_from(self, items: int, nbytes: int) -> bool:
        """Stager: before a new set of staging buffers (the old one dropped), on the thread that calls
        ``save()``: whether this set lives in a shared segment, starting the process if the state pays."""
        if self.process is None and process_pays_off(items):
            log.info(
                "safepoint: starting a writer process for async saves: the state has %d tensor items, "
                "%.1f MiB (AUTO_PROCESS_MIN_ITEMS %d)",
                items, nbytes / 2**20, AUTO_PROCESS_MIN_ITEMS,
            )  # fmt: skip
            self.process = WriterProcess(fallback=True)
            self.process.start()  # a failure is logged once; the thread writes every save then
        return self.process is not None and self.process.unavailable is None

    def _drop_arena(self) -> None:
        if self.process is not None:
            self.process.drop_arena()

    def close(self) -> None:
        if self.process is not None:
            self.process.close()
