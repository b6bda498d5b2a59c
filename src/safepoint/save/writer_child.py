"""The writer process (async_writer="process"): writes one rank's items of each async save.

Started by writer_process.WriterProcess with a launch line that ignores SIGINT and SIGTERM first, then
calls ``main([program, FD, PARENT_PID, NICE])``; FD is its end of the channel. It maps the rank's staging
segment, and for each save runs SafepointWriter.write_data (the same code as the writer thread: crc32c as
the bytes pass, fsync) over tensors that point into that segment. It keeps the last full description of a
save (plan and item views, handoff.Held), so a save of an unchanged state sends only its values. It exits
when the channel closes, and within a second of its rank dying (it must not keep writing into a save nobody
will commit).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import sys
import threading
import time
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from safepoint.errors import os_error_in_chain
from safepoint.save import ipc
from safepoint.save.handoff import Arranged, Held
from safepoint.save.shared_buffers import SharedArena
from safepoint.store.crc_switch import torch_crc32_off
from safepoint.store.file_report import split_files
from safepoint.store.storage import SafepointWriter

log = logging.getLogger("safepoint")


class _Resolved:
    """The one planner method DCP's writer calls: the data of a write item, already located."""

    def __init__(self, data: dict[MetadataIndex, Any]) -> None:
        self._data = data

    def resolve_data(self, item: WriteItem) -> Any:
        return self._data[item.index]


# A file the rank may name (an incremental save's arrangement): a rank's data file, in the save's directory.
_FILE_NAME = re.compile(r"^__\d+_\d+\.distcp$")


def _write(
    path: str,
    thread_count: int,
    plan: SavePlan,
    data: dict[MetadataIndex, Any],
    files: Arranged | None = None,
) -> tuple[list[WriteResult], dict[str, tuple[int, str]]]:
    writer = SafepointWriter(path, thread_count=thread_count)
    if files is not None:
        return _write_arranged(writer, plan, data, files), writer.written_files()
    results = writer.write_data(plan, _Resolved(data)).wait()  # type: ignore[arg-type]
    # The file list goes back on its own; the parent's ProcessWriter adds it to its results for DCP.
    return split_files([results])[1][0], writer.written_files()


def _write_arranged(
    writer: SafepointWriter, plan: SavePlan, data: dict[MetadataIndex, Any], files: Arranged
) -> list[WriteResult]:
    """An incremental save: only the files the rank arranged (the rest it linked), each with its items."""
    entries = []
    for name, positions in files:
        if not _FILE_NAME.match(name):
            raise ValueError(f"not a data file name: {name!r}")
        entries.append((os.path.join(writer.path, name), name, [plan.items[i] for i in positions]))
    wanted = sum(len(items) for _, _, items in entries)
    with torch_crc32_off():
        results = writer._write_entries(_Resolved(data), entries)  # type: ignore[arg-type]
    if len(results) != wanted:  # an extra writer thread failed (write_queue logs and drops its items)
        failure = writer.recorder.first_failure()
        what = f"writer threads wrote {len(results)} of {wanted} items"
        raise OSError(f"{what} ({failure[0]}: {failure[1]})" if failure else what)
    return results


def _failure(e: BaseException) -> tuple[Any, ...]:
    cause = os_error_in_chain(e)
    if isinstance(cause, OSError) and cause.errno is not None:
        return ("failed", type(cause).__name__, cause.errno, cause.strerror, cause.filename)
    return ("failed", type(e).__name__, None, str(e), None)


def _exit_with_parent(parent: int) -> None:
    """A rank killed mid-save leaves this process orphaned: stop rather than finish an uncommittable write
    (a blocked ``recv`` notices the closed channel by itself; a write in progress needs this)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="safepoint-parent-watch", daemon=True).start()


def serve(sock: socket.socket) -> None:
    """Answer every message with exactly one reply (the rank relies on it to keep the channel in step)."""
    arena: SharedArena | None = None
    held: Held | None = None  # the last full description of a save (handoff.py)
    ipc.send(sock, ("ready", os.getpid()))
    while True:
        try:
            msg, fds = ipc.recv(sock)
        except ipc.ChannelClosed:
            return
        if msg[0] in ("arena", "drop"):
            # One staging segment at a time: the rank replaced (or is about to replace) its buffers.
            held = None  # its views map the old segment
            if arena is not None:
                arena.release()
                arena = None  # unmapped once this save's tensors are gone too (they went with the last write)
            if msg[0] == "arena":
                arena = SharedArena.attach(fds[0], msg[2], msg[1])
            ipc.send(sock, ("ok",))
            continue
        if msg[0] == "again" and (held is None or held.key != msg[1] or held.arena_id != msg[2]):
            ipc.send(sock, ("stale",))  # the rank sends the full description next
            continue
        data: dict[MetadataIndex, Any] | None = None
        values: list[Any] | None = None
        try:
            if msg[0] == "write":
                _, key, arena_id, path, thread_count, plan, places, values, files = msg
                held = None
                if arena_id is not None and (arena is None or arena.id != arena_id):
                    raise RuntimeError(f"staging segment {arena_id} was never sent to the writer process")
                held = Held.build(key, arena, plan, places)
            else:
                _, _key, _arena_id, path, thread_count, values, files = msg
            assert held is not None
            data = held.data(values, arena)
            results, written = _write(path, thread_count, held.plan, data, files)
            reply: tuple[Any, ...] = ("done", results, written)
            if msg[0] == "again" and results == held.results:
                reply = ("same", written)  # the rank reuses the last save's results (no 5,000 to pickle)
            held.results = results
        except Exception as e:  # reported to the rank, which logs it and fails the save
            reply = _failure(e)
        del data, values  # this save's values, before waiting for the next
        ipc.send(sock, reply)


def main(argv: list[str]) -> int:
    """argv: [program, channel fd, parent pid, nice]. SIGINT and SIGTERM are already ignored (the launch
    line in writer_process does it before any import)."""
    fd, parent, nice = int(argv[1]), int(argv[2]), int(argv[3])
    logging.basicConfig(level=logging.WARNING, format="safepoint writer process: %(message)s")
    try:
        # An absolute value for the whole process (every thread): the rank's priority plus WRITER_NICE,
        # whichever thread of the rank started this process.
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as e:
        log.debug("could not set the writer process's priority: %s", e)
    torch.set_num_threads(1)
    _exit_with_parent(parent)
    sock = socket.socket(fileno=fd)
    with contextlib.suppress(ipc.ChannelClosed):  # the rank went away between messages
        serve(sock)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
