"""Helpers for the fault tests (tests/integration/test_faults_*.py): raw HTTP/1.1 on sockets, a scripted
upstream, kernel socket queues, file-descriptor counts, and the records a stack wrote. SSE stream shapes
are in stream_shapes.py, ``specproxy serve`` as a subprocess in serveproc.py.

Why raw sockets: an HTTP library normalises exactly what these tests look at (framing, header order,
hop-by-hop headers, how a peer hangs up), so both peers of the proxy are scripted byte by byte here.
Every wait has a deadline; every listener binds 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sqlite3
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rawpeers import RawUpstream, chunk  # noqa: F401  (chunk: the fault tests import it from here)


# --- waiting on conditions ------------------------------------------------------------------------


def wait_until(pred: Callable[[], object], timeout: float, interval: float = 0.01, what: str = "condition"):
    """Poll ``pred`` until it is truthy; fail after ``timeout`` seconds. Returns the truthy value."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


async def await_until(pred: Callable[[], object], timeout: float, interval: float = 0.005, what: str = "condition"):
    """``wait_until`` for coroutines: yields to the loop between checks."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = pred()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)


# --- raw HTTP/1.1 -----------------------------------------------------------------------------------


@dataclass
class Request:
    head: bytes
    body: bytes

    @property
    def line(self) -> bytes:
        return self.head.split(b"\r\n", 1)[0]

    @property
    def headers(self) -> list[tuple[str, str]]:
        out = []
        for raw in self.head.split(b"\r\n")[1:]:
            if raw:
                k, _, v = raw.partition(b":")
                out.append((k.decode("latin-1"), v.strip().decode("latin-1")))
        return out

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)


async def read_request(reader: asyncio.StreamReader, timeout: float = 10) -> Request | None:
    """One request (Content-Length or chunked body); None when the peer closed before sending one."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    req = Request(head, b"")
    length = req.header("Content-Length")
    if length is not None:
        req.body = await asyncio.wait_for(reader.readexactly(int(length)), timeout)
    elif (req.header("Transfer-Encoding") or "").lower() == "chunked":
        body = bytearray()
        while True:
            size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), timeout)).split(b";")[0], 16)
            data = await asyncio.wait_for(reader.readexactly(size + 2), timeout)
            if size == 0:
                break
            body += data[:-2]
        req.body = bytes(body)
    return req


@dataclass
class Response:
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes
    complete: bool  # the framing said where the body ends and all of it arrived
    raw: bytes = b""

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    def header_all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]


def parse_response(raw: bytes, *, head_request: bool = False) -> tuple[Response, bytes]:
    """Parse one response from the start of ``raw``; return it and the bytes after it."""
    end = raw.index(b"\r\n\r\n")
    lines = raw[:end].split(b"\r\n")
    _version, status, *reason = lines[0].split(b" ", 2)
    headers = []
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        headers.append((k.decode("latin-1"), v.strip().decode("latin-1")))
    rest = raw[end + 4 :]
    resp = Response(int(status), (reason[0] if reason else b"").decode("latin-1"), headers, b"", False, raw)
    if head_request or resp.status in (204, 304) or 100 <= resp.status < 200:
        resp.complete = True
        return resp, rest
    te = (resp.header("Transfer-Encoding") or "").lower()
    if te == "chunked":
        body = bytearray()
        pos = 0
        while True:
            nl = rest.find(b"\r\n", pos)
            if nl == -1:
                break
            size = int(rest[pos:nl].split(b";")[0], 16)
            if size == 0:
                if rest[nl + 2 : nl + 4] == b"\r\n":
                    resp.complete = True
                    pos = nl + 4
                break
            if len(rest) < nl + 2 + size + 2:
                body += rest[nl + 2 : nl + 2 + size]
                pos = len(rest)
                break
            body += rest[nl + 2 : nl + 2 + size]
            pos = nl + 2 + size + 2
        resp.body = bytes(body)
        return resp, rest[pos:]
    length = resp.header("Content-Length")
    if length is not None:
        n = int(length)
        resp.body = rest[:n]
        resp.complete = len(rest) >= n
        return resp, rest[n:]
    resp.body = rest  # close-delimited: complete only the reader knows (EOF)
    resp.complete = True
    return resp, b""


async def exchange(port: int, data: bytes, timeout: float = 10.0,
                   head_seen: asyncio.Event | None = None) -> tuple[bytes, bool]:
    """Send ``data`` on a new connection, read until the server closes; (bytes, closed_by_server).
    ``head_seen``, when given, is set once a response head is in (see ``KeptClient``)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    got = bytearray()
    closed = False
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while loop.time() < deadline:
            piece = await asyncio.wait_for(reader.read(65536), max(deadline - loop.time(), 0.001))
            if not piece:
                closed = True
                break
            got += piece
            if head_seen is not None and b"\r\n\r\n" in got:
                head_seen.set()
    except (asyncio.TimeoutError, TimeoutError):
        pass
    except ConnectionError:
        closed = True
    finally:
        writer.close()
    return bytes(got), closed


async def request_once(port: int, data: bytes, *, head_request: bool = False, timeout: float = 10):
    """One request on a new connection; its response, parsed once complete (read until then: the
    connection is not closed by the server after it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        got = b""
        while True:
            piece = await asyncio.wait_for(reader.read(65536), timeout)
            got += piece
            if b"\r\n\r\n" in got:
                resp, _ = parse_response(got, head_request=head_request)
                delimited = resp.header("Content-Length") is not None or resp.header("Transfer-Encoding")
                if resp.complete and (delimited or head_request or resp.status in (204, 304)):
                    return resp
            if not piece:
                return parse_response(got, head_request=head_request)[0] if got else None
    finally:
        writer.close()


class KeptClient:
    """One client connection kept open across requests, as a keep-alive client's: ``ask`` sends a request
    and returns its response once complete (None if the server closed first). ``head_seen``, when given,
    is set as soon as the response's head is in: an upstream script waits on it to send the body in a
    later read than the head (the relay thread takes a body only then)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self._rest = b""

    async def __aenter__(self) -> KeptClient:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    async def ask(self, data: bytes, *, head_request: bool = False, head_seen: asyncio.Event | None = None,
                  timeout: float = 10) -> Response | None:
        assert self.reader is not None and self.writer is not None
        self.writer.write(data)
        got, self._rest = self._rest, b""
        while True:
            if b"\r\n\r\n" in got:
                if head_seen is not None:
                    head_seen.set()
                resp, rest = parse_response(got, head_request=head_request)
                delimited = resp.header("Content-Length") is not None or resp.header("Transfer-Encoding")
                if resp.complete and (delimited or head_request or resp.status in (204, 304)):
                    self._rest = rest
                    return resp
            try:
                piece = await asyncio.wait_for(self.reader.read(65536), timeout)
            except ConnectionError:
                piece = b""
            if not piece:
                return parse_response(got, head_request=head_request)[0] if got else None
            got += piece


def post_head(path: str, body: bytes, extra: str = "", host: str = "proxy") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


# --- a raw upstream that serves keep-alive connections -----------------------------------------------


Responder = Callable[[Request, asyncio.StreamWriter, int], Awaitable[bool]]


class ScriptedUpstream:
    """An upstream scripted per request: ``respond(request, writer, index)`` writes a response and
    returns whether to keep the connection. Counts connections and records every request it read.

    ``serve`` is a per-connection script: give it to ``make_stack(raw_script=...)`` (it then runs on the
    stack's loop, next to the client), or ``start()`` a listener of its own."""

    def __init__(self, respond: Responder) -> None:
        self.respond = respond
        self.connections = 0
        self.open = 0
        self.requests: list[Request] = []
        self.peer_closed_at: list[float] = []  # loop time when the proxy closed a connection on us
        self.port = 0
        self._listener: RawUpstream | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> ScriptedUpstream:
        """A listener of its own (rawpeers.RawUpstream running ``serve`` per connection)."""
        self._listener = await RawUpstream(self.serve).start()
        self.port = self._listener.port
        return self

    async def close(self) -> None:
        if self._listener is not None:
            await self._listener.close()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        try:
            while True:
                req = await read_request(reader, timeout=60)
                if req is None:
                    self.peer_closed_at.append(asyncio.get_running_loop().time())
                    return
                self.requests.append(req)
                keep = await self.respond(req, writer, len(self.requests) - 1)
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            self.peer_closed_at.append(asyncio.get_running_loop().time())
        finally:
            self.open -= 1
            writer.close()


def sse_head(extra: str = "", chunked: bool = True) -> bytes:
    te = "Transfer-Encoding: chunked\r\n" if chunked else ""
    return f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n{te}{extra}\r\n".encode()

# --- the kernel's view ------------------------------------------------------------------------------


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _established(ports: set[int]):
    """(local port, remote port, send queue, receive queue) of each established TCP socket with an end on
    one of ``ports`` (both ends of each loopback connection are listed)."""
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            local, remote, state, queues = parts[1], parts[2], parts[3], parts[4]
            if state != "01":
                continue
            lport = int(local.rsplit(":", 1)[1], 16)
            rport = int(remote.rsplit(":", 1)[1], 16)
            if lport in ports or rport in ports:
                tx, rx = queues.split(":")
                yield lport, rport, int(tx, 16), int(rx, 16)


def kernel_queued(ports: set[int]) -> int:
    """Bytes sitting in kernel send and receive queues of established TCP sockets that use any of
    ``ports`` (both ends of each loopback connection are listed)."""
    return sum(tx + rx for _, _, tx, rx in _established(ports))


def kernel_received(ports: set[int]) -> int:
    """Bytes in the receive queues of the established TCP sockets whose own (local) port is one of
    ``ports``: what a read on those sockets would get now. (Bytes sent to them may sit in the sender's
    queue a while first, when the machine defers loopback delivery under load.)"""
    return sum(rx for lport, _, _, rx in _established(ports) if lport in ports)


def blackhole_listener() -> tuple[socket.socket, list[socket.socket]]:
    """A listener whose accept queue is full: a new connect to it hangs (SYNs are dropped), which is
    how a connect timeout looks on loopback. Returns the listener and the sockets filling its queue;
    it fills until a connect of its own times out, so the hole is proven, not assumed."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(0)
    port = lst.getsockname()[1]
    fillers = []
    for _ in range(16):
        s = socket.socket()
        s.settimeout(0.2)
        fillers.append(s)
        try:
            s.connect(("127.0.0.1", port))
        except (TimeoutError, socket.timeout):
            return lst, fillers
    raise AssertionError("could not fill the accept queue of a listen(0) socket")

def db_records(stack, n: int, timeout: float = 30) -> list[dict]:
    """The stack's turns as written to its database, once ``n`` have been written (oldest first)."""
    stack.settle()
    writer = stack.service.writer
    wait_until(lambda: writer.written >= n, timeout, 0.01, f"{n} rows written")
    conn = sqlite3.connect(f"file:{stack.cfg.db}?mode=ro", uri=True, timeout=5)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute("SELECT * FROM turns ORDER BY t_request")]
    finally:
        conn.close()


def db_rows(db: Path, sql: str = "SELECT id FROM turns", params: tuple = ()) -> list[tuple]:
    """Read the database the way an outside reader would (read-only, its own connection)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


# --- a port that refuses ----------------------------------------------------------------------------


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A port on 127.0.0.1 held bound but never listening for the ``with`` block: connections to it are
    refused, and no other process can take it meanwhile. (A port bound and closed at once is free for the
    kernel to hand to the next ``--port 0``: a test's exporter or sink, retrying to reach it, then talks
    to another test's proxy and adds turns there.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


# --- a small file system ----------------------------------------------------------------------------


@contextlib.contextmanager
def tiny_tmpfs(path: Path, size: str = "16m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (made here) for the test's duration (a small file system to
    fill: a full disk). Mounting needs root (CI runs as root); elsewhere the test skips and says so, and
    with ``SPECPROXY_REQUIRE_TMPFS=1`` (CI sets it) it fails instead."""
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, timeout=10)
    if done.returncode != 0:
        why = (f"needs to mount a {size} tmpfs (a full disk), which needs root: `mount` said "
               f"{done.stderr.decode(errors='replace').strip() or done.returncode}")
        if os.environ.get("SPECPROXY_REQUIRE_TMPFS") == "1":
            pytest.fail(f"{why} (SPECPROXY_REQUIRE_TMPFS=1 forbids skipping)", pytrace=False)
        pytest.skip(why)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=10)


def fill_filesystem(directory: Path) -> Path:
    """Fill a filesystem to the last byte (and prove it: a 1-byte write fails); returns the filler file
    (truncate it to give some room back, unlink it to give it all)."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for size in (1 << 20, 4096, 1):
            for _ in range(100_000):
                try:
                    os.write(fd, b"\0" * size)
                except OSError:
                    break
        with pytest.raises(OSError):
            os.write(fd, b"\0")
    finally:
        os.close(fd)
    return filler
