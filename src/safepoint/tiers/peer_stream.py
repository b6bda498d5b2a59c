"""Moving files between ranks in bounded memory (peer replicas, tiers/peers.py).

A node's share of a checkpoint can be hundreds of GB; sending each file as one tensor would hold all of it
in host memory on both ends at once. Here every (sender, receiver) pair is a stream of chunks of at most
``CHUNK_BYTES``, and the transfer runs in *waves*: in wave ``k`` each rank posts chunk ``k`` of every pair it
is in (``isend``/``irecv`` on the job's group: gloo here, NCCL the same calls) and waits for them all. Chunk
``k`` of a pair is posted in wave ``k`` on both ends, so by induction every wave completes: no deadlock for
any pattern of pairs (a ring for replication, any-to-any for a restore), and the pairs run in parallel.
A rank holds one chunk per pair it is in, whatever the files' sizes.

The receiver writes each chunk to ``<name>.part`` as it arrives, with a running crc32c; a file whose crc32c
(or size) does not match the sender's manifest entry is deleted and left out of the result. A sender whose
file is shorter than its entry, or unreadable, sends zeros for the rest so the stream stays aligned; the
receiver's check then refuses the file.

torch.distributed's own experimental ``_ReplicationStager``/``PGTransport`` sends a whole state dict at once
and pairs rank r with r + world/2 (possibly on the same node), which is why this is our own.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import crc32c
import torch
import torch.distributed as dist

from safepoint.dist import Comm
from safepoint.store.checksum import crc_hex
from safepoint.store.rootfs import Rel, RootDir

log = logging.getLogger("safepoint")
CHUNK_BYTES = 64 << 20
"""Bytes per message. Memory per rank during a transfer is one chunk per pair the rank is in."""

Entry = tuple[str, int, str]  # name, size, crc32c
Plan = list[tuple[int, int, Entry]]  # (sender, receiver, file), in the same order on every rank
# One step of a pair's stream on this rank: ("send", tensor) or ("recv", tensor); after a "recv" completes
# the stream is resumed (its generator consumes the buffer).
Step = tuple[str, torch.Tensor]


def exchange(
    comm: Comm, plan: Plan, fs: RootDir, read: Mapping[str, Rel], into: str, chunk: int = CHUNK_BYTES
) -> dict[str, Path]:
    """Run ``plan``: this rank sends the files it is the sender of (from ``read``, under ``fs``) and writes
    those it receives under ``into`` (a name under ``fs``, created if needed); returns name -> path of the
    received files whose size and crc32c match their entry. Collective over the ranks named in ``plan``;
    others return at once. Every file is opened through the guarded walk (store/rootfs.py): a symlink on
    the way (a symlinked ``.pending``) fails that file, in step with its peer, and is never followed."""
    pairs: dict[tuple[int, int], list[Entry]] = {}
    for src, dst, entry in plan:
        if comm.rank in (src, dst) and src != dst:
            pairs.setdefault((src, dst), []).append(entry)
    received: dict[str, Path] = {}
    streams: list[tuple[int, Iterator[Step]]] = []
    for (src, dst), entries in pairs.items():
        if comm.rank == src:
            streams.append((dst, _outgoing(entries, fs, read, chunk)))
        else:
            with contextlib.suppress(OSError):  # if it cannot be made, each file fails alone (in step)
                fs.makedirs(into)
            streams.append((src, _incoming(entries, fs, into, chunk, received)))
    live = [(peer, stream, next(stream, None)) for peer, stream in streams]
    while live := [item for item in live if item[2] is not None]:
        works = []
        for peer, _, step in live:
            assert step is not None
            kind, tensor = step
            op = dist.isend if kind == "send" else dist.irecv
            works.append(op(tensor, comm._global(peer), group=comm.group))
        comm._run("peer transfer", _wait_all, works)
        live = [(peer, stream, next(stream, None)) for peer, stream, _ in live]
    return received


def _bytes_of(buf: torch.Tensor) -> memoryview:
    """A writable byte view of a uint8 CPU tensor (no copy): files are read into and written from it."""
    return memoryview(buf.numpy()).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers


def _wait_all(works: list[Any]) -> None:
    for w in works:
        w.wait()


def _outgoing(entries: list[Entry], fs: RootDir, read: Mapping[str, Rel], chunk: int) -> Iterator[Step]:
    buf = torch.empty(min(chunk, max((size for _, size, _ in entries), default=0)), dtype=torch.uint8)
    view = _bytes_of(buf)
    for name, size, _ in entries:
        fd, path = -1, read.get(name)
        if path is not None:
            with contextlib.suppress(OSError):
                fd = fs.open_read(path)
        try:
            for off in range(0, size, chunk):
                n = min(chunk, size - off)
                got = 0
                try:
                    while fd >= 0 and got < n and (k := os.readv(fd, [view[got:n]])):
                        got += k
                except OSError as e:
                    log.warning("safepoint: cannot read %s for a peer (%s); sending zeros", name, e)
                    os.close(fd)
                    fd = -1
                view[got:n] = bytes(n - got)  # short or unreadable: zeros keep the stream aligned
                yield "send", buf[:n]
        finally:
            if fd >= 0:
                os.close(fd)


def _incoming(
    entries: list[Entry], fs: RootDir, into: str, chunk: int, received: dict[str, Path]
) -> Iterator[Step]:
    """Receive ``entries`` in order. Every chunk is received even when it cannot be written here (a full
    disk, a symlinked directory): the wave stays in step with the sender, and the file is left out of
    ``received``. Each ``<name>.part`` is made by RootDir.create: a symlink planted there is unlinked,
    never written through."""
    buf = torch.empty(min(chunk, max((size for _, size, _ in entries), default=0)), dtype=torch.uint8)
    for name, size, crc in entries:
        part = f"{into}/{name}.part"
        value, problem = 0, None
        try:
            f = os.fdopen(fs.create(part), "wb")
        except OSError as e:
            f, problem = None, str(e)
        for off in range(0, size, chunk):
            n = min(chunk, size - off)
            yield "recv", buf[:n]
            data = _bytes_of(buf)[:n]
            value = crc32c.crc32c(data, value)
            if f is not None and problem is None:
                try:
                    f.write(data)
                except OSError as e:
                    problem = str(e)
        if f is not None:
            try:
                f.flush()
                os.fsync(f.fileno())
            except OSError as e:
                problem = problem or str(e)
            finally:
                with contextlib.suppress(OSError):  # closed whatever happened: no descriptor left open
                    f.close()
        if problem is None and crc_hex(value) != crc:
            problem = f"crc32c {crc_hex(value)} != {crc}"
        if problem is None:
            try:  # an OSError here (a directory in the way) must not end this rank's waves early
                fs.move(part, f"{into}/{name}")
                received[name] = fs.full(f"{into}/{name}")
            except OSError as e:
                problem = str(e)
        if problem is not None:
            with contextlib.suppress(OSError):
                fs.remove(part)
            log.warning("safepoint: %s from a peer not kept: %s", name, problem)
