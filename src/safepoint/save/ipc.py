"""Messages between a rank and its writer process: length-prefixed pickles, file descriptors alongside.

The socket is a private ``socketpair`` held only by the two processes (both running safepoint), so its
pickles come from our own code, never from a checkpoint. multiprocessing's Connection cannot carry
descriptors and torch.multiprocessing needs the spawn machinery (which re-imports the user's script), so
the framing is ours: an 8-byte header (payload length, descriptor count) with the descriptors attached to
it as SCM_RIGHTS, then the payload.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import socket
import struct
from typing import Any

_HEADER = struct.Struct("<IHxx")
# The kernel passes at most 253 descriptors per message (SCM_MAX_FD); we send one per staging segment.
MAX_FDS = 250


class ChannelClosed(EOFError):
    """The other process closed its end (it exited or died)."""


def send(sock: socket.socket, obj: Any, fds: list[int] | None = None) -> None:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    fds = fds or []
    if len(fds) > MAX_FDS:
        raise ValueError(f"at most {MAX_FDS} descriptors per message, got {len(fds)}")
    header = _HEADER.pack(len(payload), len(fds))
    try:
        # MSG_NOSIGNAL: a dead peer is an error here, never a SIGPIPE (which a script may have set to kill).
        if fds:
            sent = socket.send_fds(sock, [header], fds, socket.MSG_NOSIGNAL)
            if sent < len(header):
                sock.sendall(header[sent:], socket.MSG_NOSIGNAL)
        else:
            sock.sendall(header, socket.MSG_NOSIGNAL)
        sock.sendall(payload, socket.MSG_NOSIGNAL)
    except (BrokenPipeError, ConnectionResetError) as e:
        raise ChannelClosed(str(e)) from e


def recv(sock: socket.socket) -> tuple[Any, list[int]]:
    """The next message and the descriptors that came with it (the caller closes them)."""
    try:
        first, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, MAX_FDS)
    except ConnectionResetError as e:
        raise ChannelClosed(str(e)) from e
    if not first:
        raise ChannelClosed("the other end closed the channel")
    header = first + _recv_exact(sock, _HEADER.size - len(first))
    length, nfds = _HEADER.unpack(header)
    if nfds != len(fds):
        _close(list(fds))
        raise ChannelClosed(f"expected {nfds} descriptors, received {len(fds)}")
    try:
        return pickle.loads(_recv_exact(sock, length)), list(fds)
    except BaseException:
        _close(list(fds))
        raise


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except ConnectionResetError as e:
            raise ChannelClosed(str(e)) from e
        if k == 0:
            raise ChannelClosed("the other end closed the channel mid-message")
        got += k
    return bytes(buf)


def _close(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def readable(sock: socket.socket, timeout_s: float) -> bool:
    """Whether ``sock`` has data (or EOF) within ``timeout_s``. poll, not select: select refuses descriptors
    numbered 1024 or more, and in a process with many files open (data loaders, a library's leaked
    descriptors) a writer process started later gets such a channel: every async save then failed."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))
