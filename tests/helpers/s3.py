"""A real S3 endpoint on loopback (moto's server mode) and a fault-injecting HTTP proxy in front of it.

Everything goes through real s3fs/aiobotocore over HTTP: nothing is patched in-process. The proxy forwards
each request to moto unless a rule says otherwise: answer ``503 SlowDown``, reset the connection, or hold
the request until released (to freeze an upload mid-way and SIGKILL its process).

For the torture suite (tests/torture/objstore.py) the proxy also counts every *mutation* a client issues
(PUT, upload-part, copy, multipart create/complete/abort, DELETE, batch delete) in a ``Session`` the client
opens with a control request (``/__safepoint__/hello``, giving its pid). At the session's k-th mutation it
can SIGKILL the client just before the store sees it, or just after the store applied it (the answer
never arrives), answer it with an error in the store's own words (tests/helpers/store_errors.py: S3's
``503 SlowDown``, retried by the client, and ``403 AccessDenied``, not retried; GCS's and Azure's alike),
once or until the client says the store has recovered (``/__safepoint__/disarm``), or apply it and
reset the connection (the answer is lost, the client retries). The session's journal holds every
mutation in the order the store received them, with the client's own progress marks in between.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import logging
import os
import re
import signal
import socket
import struct
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.helpers import botocore_data, mutations, s3_pages, store_errors

if TYPE_CHECKING:
    import safepoint

CONTROL = "/__safepoint__/"


def _key_errors(body: bytes) -> bytes:
    """A DeleteObjects answer (HTTP 200) in which every key failed, as S3 reports per-key trouble."""
    errors = b"".join(
        b"<Error><Key>" + k + b"</Key><Code>InternalError</Code><Message>We encountered an internal error. "
        b"Please try again.</Message></Error>"
        for k in re.findall(rb"<Key>(.*?)</Key>", body)
    )
    return b'<?xml version="1.0" encoding="UTF-8"?><DeleteResult>' + errors + b"</DeleteResult>"


@dataclass
class Session:
    """One client's mutations, counted and journalled; a fault at the ``at``-th (1-based)."""

    case: str
    pid: int
    mode: str = "count"  # count | crash | fail | lost
    at: int = 0
    when: str = "before"  # crash: just before the store sees request ``at``, or just after it applied it
    # fail: "503" (SlowDown, retried) | "403" (AccessDenied, not retried) | "key-errors" (a batch delete
    # answered 200 with every key failed)
    error: str = "503"
    sticky: bool = False  # fail: every mutation from ``at`` on fails, until the client disarms the fault
    count: int = 1  # fail: how many mutations in a row fail (when not sticky)
    armed: bool = True
    n: int = 0
    # The read campaign (tests/torture/objreads.py): ``reads`` counts every read too (mode "count"), and
    # mode "read" faults the ``at``-th read instead of a mutation (``error``: READ_FAULTS).
    reads: bool = False
    r: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    dead: bool = False

    def reached(self) -> bool:
        return (self.r if self.mode == "read" else self.n) >= self.at

    def read_action(self, r: int) -> str:
        if not self.armed or self.mode != "read" or r < self.at:
            return "forward"
        return self.error if r < self.at + self.count or self.sticky else "forward"

    def action(self, n: int) -> str:
        if not self.armed or self.mode in ("count", "read") or n < self.at:
            return "forward"
        if self.mode == "crash" and n == self.at:
            return f"crash-{self.when}"
        if self.mode == "lost" and n == self.at:
            return "lost"
        if self.mode == "fail" and (n < self.at + self.count or self.sticky):
            return self.error
        return "forward"

    @property
    def ops(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["ev"] == "op"]


def _kill(pid: int) -> None:
    """SIGKILL ``pid`` and wait until it is gone (dead or a zombie): nothing it does comes after."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.002)


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
    # "503" | "NoSuchUpload" (S3's words) | "reset" | "lost" (applied, answer lost) | "hold" | "short" (a
    # listing cut to its first half, marked complete)
    action: str
    method: str | None = None
    path: str | None = None  # regex searched in the request path
    count: int = -1  # how many requests it applies to; -1 = all
    skip: int = 0  # let this many matching requests through first
    hits: int = 0


@dataclass
class FaultProxy:
    upstream: int
    port: int = 0
    rules: list[Rule] = field(default_factory=list)
    seen: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, what happened)
    body_bytes: dict[str, int] = field(default_factory=dict)  # request body bytes per object path
    release: threading.Event = field(default_factory=threading.Event)
    held: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    sessions: dict[str, Session] = field(default_factory=dict)
    session: Session | None = None  # the one counting now (one client at a time)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(
        self,
        action: str,
        *,
        method: str | None = None,
        path: str | None = None,
        count: int = -1,
        skip: int = 0,
    ) -> Rule:
        rule = Rule(action, method, path, count, skip)
        with self.lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()
        self.release.set()

    def hold(self, *, method: str | None = None, path: str | None = None, count: int = -1) -> Rule:
        """Hold matching requests until ``release`` is set; ``held`` is set when the first one arrives."""
        self.held.clear()
        self.release.clear()
        return self.add("hold", method=method, path=path, count=count)

    def decide(self, method: str, path: str) -> str:
        with self.lock:
            for rule in self.rules:
                if rule.count == 0:
                    continue
                if rule.method and rule.method != method:
                    continue
                if rule.path and not re.search(rule.path, path):
                    continue
                if rule.skip > 0:
                    rule.skip -= 1
                    return "forward"
                rule.hits += 1
                if rule.count > 0:
                    rule.count -= 1
                return rule.action
            return "forward"

    def faults(self) -> int:
        return sum(1 for _, _, what in self.seen if what != "forward")

    def control(self, path: str, body: bytes) -> None:
        """A client's control request: open a session (``hello``), a progress ``mark``, ``disarm``."""
        msg = json.loads(body or b"{}")
        what = path[len(CONTROL) :]
        with self.lock:
            if what == "hello":
                fields = {f for f in Session.__dataclass_fields__ if f not in ("events", "n", "r", "dead")}
                s = Session(**{k: v for k, v in msg.items() if k in fields})
                s.events.append({"ev": "hello", **msg})
                self.session = self.sessions[msg["case"]] = s
            elif self.session is not None and what == "mark":
                self.session.events.append({"ev": "mark", **msg})
            elif self.session is not None and what == "disarm" and self.session.reached():
                # (a fault not reached yet stays armed: the client disarms after every save)
                self.session.armed = False
                self.session.events.append({"ev": "disarm"})

    def read(self, kind: str, key: str) -> tuple[Session | None, int, str]:
        """Count a read in the open session, if it counts reads: (session, its number, what to do)."""
        with self.lock:
            s = self.session
            if s is None or not (s.reads or s.mode == "read") or s.dead:
                return None, 0, "forward"
            s.r += 1
            s.events.append({"ev": "read", "op": kind, "key": key, "j": s.r})
            return s, s.r, s.read_action(s.r)

    def mutation(self, m: mutations.Mutation) -> tuple[Session | None, int, str]:
        """Count a mutation in the open session: (session, its number, what to do with it)."""
        with self.lock:
            s = self.session
            if s is None:
                return None, 0, "forward"
            ev: dict[str, Any] = {"ev": "op", "op": m.kind, "key": m.key}
            if m.keys:
                ev["keys"] = m.keys
            if s.dead:  # sent before the client died, arriving after: the store still gets it
                s.events.append({**ev, "ev": "late"})
                return s, 0, "forward"
            s.n += 1
            s.events.append({**ev, "i": s.n})
            return s, s.n, s.action(s.n)


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

        def _reply(self, status: int, data: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for k, v in (headers or {"Content-Type": "application/xml"}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _reset(self) -> None:
            # RST instead of FIN: the client sees "connection reset by peer" mid-request.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True

        def _handle(self) -> None:
            body = self._body()
            if self.path.startswith(CONTROL):
                proxy.control(self.path, body)
                self._reply(200, b"{}")
                return
            mutation = mutations.parse(self.command, self.path, self.headers, body)
            if mutation is not None and proxy.session is not None:
                self._session(mutation, body)
                return
            kind = mutations.read_kind(self.command, self.path, self.headers)
            if kind is not None and proxy.session is not None:
                session, j, what = proxy.read(kind, self.path)
                if session is not None and what != "forward":
                    session.events.append({"ev": "fail", "j": j, "error": what})
                    self._read_fault(what, kind)
                    return
            what = proxy.decide(self.command, self.path)
            proxy.seen.append((self.command, self.path, what))
            key = self.path.split("?")[0]
            proxy.body_bytes[key] = proxy.body_bytes.get(key, 0) + len(body)
            if what == "hold":
                proxy.held.set()
                proxy.release.wait()
                what = "forward"
            if what == "reset":
                self._reset()
                return
            if what == "lost":  # the store applies it; the answer never arrives (the client retries)
                self._forward(body, answer=False)
                self._reset()
                return
            if what in ("503", "NoSuchUpload"):
                status, headers, data = store_errors.reply(
                    store_errors.store_of(self.path, self.headers), what
                )
                self._reply(status, data, headers)
                return
            if what == "short":  # a listing cut to its first half, marked complete (READ_FAULTS)
                self._forward(body, rewrite=short_listing)
                return
            if what == "one-upload-per-page":  # S3's paging of a multipart-upload listing (s3_pages.py)
                self._forward(body, rewrite=lambda data: s3_pages.one_upload_per_page(self.path, data))
                return
            self._forward(body)

        def _read_fault(self, what: str, kind: str) -> None:
            """A read answered wrong (READ_FAULTS): an error, no answer, half an answer, a short listing,
            or an answer later than the client waits."""
            if what == "503":
                status, headers, data = store_errors.reply(
                    store_errors.store_of(self.path, self.headers), what
                )
                if self.command == "HEAD":  # the length of the body a GET would get, and no body
                    self.send_response(status)
                    for k, v in {**headers, "Content-Length": str(len(data))}.items():
                        self.send_header(k, v)
                    self.end_headers()
                else:
                    self._reply(status, data, headers)
            elif what == "reset":
                self._reset()
            elif what == "truncate" and kind != "head":  # the length announced, half the bytes sent
                self._forward(b"", rewrite=_half, cut=True)
            elif what == "short" and kind == "list":  # a listing that says it is complete, half of it
                self._forward(b"", rewrite=short_listing)
            elif what == "slow":
                time.sleep(SLOW_S)  # past the client's read timeout: it gave up (and retried) already
                self._forward(b"")
            else:  # a HEAD has no body to cut: its answer is lost instead
                self._reset()

        def _session(self, mutation: mutations.Mutation, body: bytes) -> None:
            session, n, what = proxy.mutation(mutation)
            assert session is not None
            if what in ("503", "403"):  # in the words of the store the request is for
                session.events.append({"ev": "fail", "i": n, "error": what})
                status, headers, data = store_errors.reply(
                    store_errors.store_of(self.path, self.headers), what
                )
                self._reply(status, data, headers)
                return
            if what == "key-errors":  # a batch delete answered 200, every key failed (InternalError)
                session.events.append({"ev": "fail", "i": n, "error": what})
                self._reply(200, _key_errors(body))
                return
            if what == "crash-before":
                session.events.append({"ev": "crash", "i": n, "when": "before"})
                session.dead = True
                _kill(session.pid)
                self.close_connection = True
                return
            status = self._forward(body, answer=what == "forward")
            session.events.append({"ev": "done", "i": n, "status": status})
            if what == "crash-after":  # the store applied it; the client dies before it hears so
                session.events.append({"ev": "crash", "i": n, "when": "after"})
                session.dead = True
                _kill(session.pid)
                self.close_connection = True
            elif what == "lost":  # applied, the answer lost on the way: the client retries
                session.events.append({"ev": "lost", "i": n})
                self._reset()

        def _forward(
            self,
            body: bytes,
            answer: bool = True,
            rewrite: Callable[[bytes], bytes] | None = None,
            cut: bool = False,
        ) -> int:
            conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream, timeout=120)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            finally:
                conn.close()
            if not answer:
                return resp.status
            full = len(data)
            if rewrite is not None and (resp.status == 200 or (cut and resp.status == 206)):
                data = rewrite(data)
            self.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "content-length", "connection", "date", "server"):
                    self.send_header(k, v)
            length = resp.getheader("Content-Length") if self.command == "HEAD" else None
            if cut:  # the whole length announced, the (rewritten: shortened) bytes sent, then a reset
                length = str(full)
            self.send_header("Content-Length", length or str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            if cut:
                self.wfile.flush()
                self._reset()
            return resp.status

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    return Handler


# What the read campaign does to the chosen read (Session mode "read"): answer it with the store's 503,
# reset the connection without an answer, send the headers and half the body, answer a listing with its
# first half as if that were all (a store whose listing lags or drops keys), or answer after SLOW_S
# (past the client's read timeout).
READ_FAULTS = ("503", "reset", "truncate", "short", "slow")
SLOW_S = 3.0


def _half(data: bytes) -> bytes:
    return data[: len(data) // 2]


def short_listing(data: bytes) -> bytes:
    """A listing page (S3's XML, GCS's or Azure's) cut to its first half of entries and marked complete."""
    if data.lstrip().startswith(b"{"):  # GCS: {"items": [...], "nextPageToken": ...}
        doc = json.loads(data)
        items = doc.get("items", [])
        doc["items"] = items[: len(items) // 2]
        doc.pop("nextPageToken", None)
        return json.dumps(doc).encode()
    for tag in (b"Contents", b"Upload", b"Blob"):  # S3 objects, S3 multipart uploads, Azure blobs
        entries = re.findall(rb"<" + tag + rb">.*?</" + tag + rb">", data, flags=re.S)
        if entries:
            for e in entries[len(entries) // 2 :]:
                data = data.replace(e, b"", 1)
            break
    data = re.sub(rb"<IsTruncated>true</IsTruncated>", b"<IsTruncated>false</IsTruncated>", data)
    data = re.sub(rb"<NextContinuationToken>.*?</NextContinuationToken>", b"", data)
    data = re.sub(rb"<NextMarker>.+?</NextMarker>", b"<NextMarker/>", data)
    return data


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients hanging up on a reset or a killed process: expected here


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    with pytest.MonkeyPatch.context() as mp:
        botocore_data.share(mp.setattr)  # botocore's data files parsed once for this process
        yield from _moto_endpoint()


def _moto_endpoint() -> Iterator[str]:
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
    return new_bucket(moto_endpoint)


def new_bucket(endpoint: str) -> str:
    import boto3

    name = f"t-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@contextlib.contextmanager
def running_proxy(moto_endpoint: str) -> Iterator[FaultProxy]:
    """A FaultProxy in front of ``moto_endpoint``, served on its own threads until the block ends."""
    upstream = int(urllib.parse.urlsplit(moto_endpoint).port or 80)  # any store's endpoint, in fact
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


@pytest.fixture
def proxy(moto_endpoint: str) -> Iterator[FaultProxy]:
    with running_proxy(moto_endpoint) as fp:
        yield fp


def tiered_manager(tmp_path: Path, proxy: FaultProxy, bucket: str, **kw: Any) -> safepoint.CheckpointManager:
    """A manager tiering from ``tmp_path/local`` to ``s3://bucket/run`` through ``proxy``: a save every 5
    steps, 5 kept locally."""
    # Imported here, not at the top: the root conftest imports this module, and pytest-xdist's controller
    # (which runs no test) would otherwise import torch and DCP before it starts the workers.
    import safepoint

    return safepoint.CheckpointManager(
        f"s3://{bucket}/run",
        local_root=tmp_path / "local",
        storage_options=storage_options(proxy.endpoint),
        save_every_steps=5,
        **kw,
        keep=safepoint.Keep(local_last=5),
    )
