"""A loopback TCP proxy in front of any server: it counts and alters bytes without speaking the protocol.

It serves S3 (moto), GCS (fake-gcs-server) and Azure (Azurite) alike, because it only moves bytes: a
test points a store's endpoint at it and then counts what a restore downloads (``down``), alters the
request bytes on the way (``corrupt``: every occurrence of a marker in what the client sends, so a body
arrives damaged as it would on a bad link) or the response bytes (``corrupt_down``: a status the server
could have sent), or resets connections once the client has sent a number of
bytes (``reset_after``: a network fault in the middle of an upload).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from tests.helpers.stores import Store, azure_store, gcs_store, s3_store

_CHUNK = 256 * 1024


@dataclass
class TcpProxy:
    host: str
    port: int
    listen_port: int = 0
    up: int = 0
    """Bytes the clients sent (requests)."""
    down: int = 0
    """Bytes the server sent back (responses)."""
    corrupt: tuple[bytes, bytes] | None = None
    """(marker, replacement): each chunk from the client has the marker replaced (same length)."""
    corrupt_times: int = -1
    """How many chunks to alter; -1 = all."""
    corrupted: int = 0
    corrupt_down: tuple[bytes, bytes] | None = None
    """(marker, replacement) in what the server sends back (a response header, say), the same way."""
    corrupt_down_times: int = -1
    corrupted_down: int = 0
    reset_after: int | None = None
    """Reset every connection open at the moment the clients' bytes pass this total (once)."""
    resets: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _conns: list[socket.socket] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    def reset_counts(self) -> None:
        with self._lock:
            self.up = self.down = 0

    def _alter(self, data: bytes) -> bytes:
        if self.corrupt is None or self.corrupt_times == 0:
            return data
        marker, replacement = self.corrupt
        if marker not in data:
            return data
        with self._lock:
            if self.corrupt_times == 0:
                return data
            self.corrupt_times -= 1 if self.corrupt_times > 0 else 0
            self.corrupted += 1
        return data.replace(marker, replacement)

    def _alter_down(self, data: bytes) -> bytes:
        if self.corrupt_down is None or self.corrupt_down_times == 0:
            return data
        marker, replacement = self.corrupt_down
        if marker not in data:
            return data
        with self._lock:
            if self.corrupt_down_times == 0:
                return data
            self.corrupt_down_times -= 1 if self.corrupt_down_times > 0 else 0
            self.corrupted_down += 1
        return data.replace(marker, replacement)

    def _pump(self, src: socket.socket, dst: socket.socket, upward: bool) -> None:
        try:
            while data := src.recv(_CHUNK):
                if upward:
                    data = self._alter(data)
                    with self._lock:
                        self.up += len(data)
                        trip = self.reset_after is not None and self.up >= self.reset_after
                        if trip:
                            self.reset_after = None
                            self.resets += 1
                    if trip:
                        self._reset_all()
                        return
                else:
                    data = self._alter_down(data)
                    with self._lock:
                        self.down += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def _reset_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                # SO_LINGER 0: close sends RST, as a broken network does
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                s.close()

    def serve(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection((self.host, self.port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for src, dst, upward in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, upward), daemon=True).start()


@contextlib.contextmanager
def tcp_proxy(endpoint: str) -> Iterator[TcpProxy]:
    """A TcpProxy in front of ``endpoint`` (http://host:port[/...]) until the block ends."""
    hostport = endpoint.split("://", 1)[1].split("/", 1)[0]
    host, port = hostport.rsplit(":", 1)
    proxy = TcpProxy(host, int(port))
    listener = socket.create_server(("127.0.0.1", 0))
    proxy.listen_port = listener.getsockname()[1]
    thread = threading.Thread(target=proxy.serve, args=(listener,), daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        listener.close()
        proxy._reset_all()


def proxied(store: Store, proxy: TcpProxy) -> Store:
    """The same store as ``store``, reached through ``proxy`` (which fronts ``store.endpoint``)."""
    rest = store.endpoint.split("://", 1)[1].split("/", 1)
    path = f"/{rest[1]}" if len(rest) > 1 else ""
    via = proxy.endpoint + path
    if store.scheme == "s3":
        return s3_store(via)
    if store.scheme == "gs":
        return gcs_store(via)
    return azure_store(via)


def hide_crc32c(proxy: TcpProxy) -> None:
    """Make ``proxy`` hide every CRC32C an S3 server reports (the headers, the checksum type, the XML
    elements of a completion's or a copy's answer): an S3-compatible store that keeps none (older MinIO,
    Ceph RGW, R2, appliances), played by moto."""
    proxy.corrupt_down = (b"x-amz-checksum-crc32c", b"x-amz-checksum-crc32x")
    hide_headers = proxy._alter_down

    def hide(data: bytes) -> bytes:
        data = hide_headers(data).replace(b"ChecksumCRC32C>", b"ChecksumCRC32X>")
        return data.replace(b"x-amz-checksum-type", b"x-amz-checksum-typx")

    proxy._alter_down = hide  # type: ignore[method-assign]


def proxied_options(store: Store, proxy_endpoint: str) -> dict[str, object]:
    """``store``'s storage options with its endpoint replaced by a proxy's (any proxy at that URL)."""
    p = TcpProxy("", 0, listen_port=int(proxy_endpoint.rsplit(":", 1)[1]))
    return proxied(store, p).options
