"""A real S3 endpoint on loopback (moto's server mode) and a fault-injecting HTTP proxy in front of it.

Everything goes through real s3fs/aiobotocore over HTTP: nothing is patched in-process. The proxy forwards
each request to moto unless a rule says otherwise: answer ``503 SlowDown``, reset the connection, or hold
the request until released (to freeze an upload mid-way and SIGKILL its process).
"""

from __future__ import annotations

import http.client
import http.server
import logging
import os
import re
import socket
import struct
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def storage_options(endpoint: str, **extra: Any) -> dict[str, Any]:
    """s3fs options for the test endpoint. botocore's own retries are off so that safepoint's are the
    ones tested (users keep botocore's defaults; safepoint retries on top of them)."""
    opts: dict[str, Any] = {
        "client_kwargs": {"endpoint_url": endpoint},
        "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}, "connect_timeout": 5},
    }
    opts.update(extra)
    return opts


@dataclass
class Rule:
    action: str  # "503" | "reset" | "hold"
    method: str | None = None
    path: str | None = None  # regex searched in the request path
    count: int = -1  # how many requests it applies to; -1 = all
    hits: int = 0


@dataclass
class FaultProxy:
    upstream: int
    port: int = 0
    rules: list[Rule] = field(default_factory=list)
    seen: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, what happened)
    release: threading.Event = field(default_factory=threading.Event)
    held: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(
        self, action: str, *, method: str | None = None, path: str | None = None, count: int = -1
    ) -> Rule:
        rule = Rule(action, method, path, count)
        with self.lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()
        self.release.set()

    def decide(self, method: str, path: str) -> str:
        with self.lock:
            for rule in self.rules:
                if rule.count == 0:
                    continue
                if rule.method and rule.method != method:
                    continue
                if rule.path and not re.search(rule.path, path):
                    continue
                rule.hits += 1
                if rule.count > 0:
                    rule.count -= 1
                return rule.action
            return "forward"

    def faults(self) -> int:
        return sum(1 for _, _, what in self.seen if what != "forward")


def _handler(proxy: FaultProxy) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0], 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline()
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _handle(self) -> None:
            body = self._body()
            what = proxy.decide(self.command, self.path)
            proxy.seen.append((self.command, self.path, what))
            if what == "hold":
                proxy.held.set()
                proxy.release.wait()
                what = "forward"
            if what == "reset":
                # RST instead of FIN: the client sees "connection reset by peer" mid-request.
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                return
            if what == "503":
                self.send_response(503)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(_SLOWDOWN)))
                self.end_headers()
                self.wfile.write(_SLOWDOWN)
                return
            conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream, timeout=120)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            finally:
                conn.close()
            self.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "content-length", "connection", "date", "server"):
                    self.send_header(k, v)
            length = resp.getheader("Content-Length") if self.command == "HEAD" else None
            self.send_header("Content-Length", length or str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    return Handler


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients hanging up on a reset or a killed process: expected here


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    saved = {
        k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    }
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1"
    )
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def bucket(moto_endpoint: str) -> str:
    """A fresh bucket per test (moto keeps state for the whole session)."""
    import boto3

    name = f"t-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture
def proxy(moto_endpoint: str) -> Iterator[FaultProxy]:
    upstream = int(moto_endpoint.rsplit(":", 1)[1])
    fp = FaultProxy(upstream=upstream)
    server = _QuietServer(("127.0.0.1", 0), _handler(fp))
    server.daemon_threads = True
    fp.port = int(server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fp
    finally:
        fp.clear()
        server.shutdown()
        server.server_close()
