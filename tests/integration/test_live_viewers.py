"""The live page's event stream cannot hold the proxy up: a viewer that stops reading is dropped after
the write timeout (the others go on), and at most ``MAX_VIEWERS`` watch at once.

The ``Admin`` under test is the proxy's own, served by aiohttp on 127.0.0.1; its pictures come from a
stand-in ``Pages`` whose size and version the test sets (what is drawn is not what is tested here).
"""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest
from aiohttp import web

from specproxy.config import Config
from specproxy.serve.admin import MAX_VIEWERS, Admin
from specproxy.serve.own_metrics import OwnMetrics

BIG = 16 * 1024 * 1024  # a picture larger than any socket buffers between us: a non-reader blocks its write


class Pictures:
    def __init__(self, size: int) -> None:
        self.size = size

    def document(self) -> str:
        return "<html>live</html>"

    def fragment(self) -> str:
        return "x" * self.size


async def until(cond, timeout: float = 60.0) -> None:
    """A bounded wait on the server's own count of viewers (it changes on the loop this test runs on)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


@pytest.fixture
async def serve_admin():
    runners = []

    async def start(admin: Admin) -> int:
        runner = web.ServerRunner(web.Server(admin.handle))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append((admin, runner))
        return runner.addresses[0][1]

    yield start
    for admin, runner in runners:
        admin.close()
        await runner.cleanup()


async def raw_viewer(port: int, rcvbuf: int | None = None) -> socket.socket:
    """A viewer that asks for the events and reads nothing more than the test asks it to."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, b"GET /_specproxy/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    return sock


async def read_until(sock: socket.socket, needle: bytes, timeout: float = 20.0) -> bytes:
    loop = asyncio.get_running_loop()
    got = b""
    async with asyncio.timeout(timeout):
        while needle not in got:
            data = await loop.sock_recv(sock, 65536)
            assert data, got[:200]
            got += data
    return got


async def next_picture(resp: aiohttp.ClientResponse, timeout: float = 60.0) -> int:
    """Read one whole ``data:`` message; its size. Linear in what it reads (each read searched once, from a
    little before it): a reader that rescanned all 16 MB at every read fell behind on a busy machine until the
    proxy's write timeout dropped it as a non-reader."""
    got = bytearray()
    start = -1
    async with asyncio.timeout(timeout):
        while True:
            seen = len(got)
            got += await resp.content.readany()
            if start < 0:
                start = got.find(b"data: ", max(0, seen - 5))
            if start >= 0:
                end = got.find(b"\n\n", max(start, seen - 1))
                if end >= 0:
                    return end - start


@pytest.mark.alone
async def test_a_viewer_that_stops_reading_is_dropped_and_the_others_go_on(serve_admin):
    version = {"v": 1}
    # 3 s without progress drops a viewer: the reader below never stalls that long, even on a loaded machine
    admin = Admin(Config(), OwnMetrics(), lambda: version["v"], Pictures(BIG), write_timeout_s=3.0)
    port = await serve_admin(admin)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/_specproxy/events") as reader:
            assert reader.status == 200
            assert await next_picture(reader) > BIG  # it reads: it gets the whole picture
            await until(lambda: admin.viewers == 1)
            slow = await raw_viewer(port, rcvbuf=4096)  # asks, then never reads
            try:
                await until(lambda: admin.viewers == 2)
                await until(lambda: admin.viewers == 1)  # its write timed out: dropped, the reader still there
                version["v"] = 2
                assert await next_picture(reader) > BIG  # and the reader gets the next picture
                assert admin.viewers == 1
            finally:
                slow.close()


async def test_at_most_max_viewers_watch_at_once(serve_admin):
    version = {"v": 1}
    admin = Admin(Config(), OwnMetrics(), lambda: version["v"], Pictures(100))
    port = await serve_admin(admin)
    viewers = [await raw_viewer(port) for _ in range(MAX_VIEWERS)]
    try:
        for sock in viewers:
            await read_until(sock, b": specproxy live")
        assert admin.viewers == MAX_VIEWERS == 16
        extra = await raw_viewer(port)
        answer = await read_until(extra, b"live viewers")
        extra.close()
        assert answer.startswith(b"HTTP/1.1 503") and b"more than 16 live viewers" in answer
        viewers.pop().close()  # one leaves: noticed at the next picture, and its place is free
        version["v"] = 2
        await until(lambda: admin.viewers == MAX_VIEWERS - 1)
        viewers.append(await raw_viewer(port))
        assert (await read_until(viewers[-1], b": specproxy live")).startswith(b"HTTP/1.1 200")
    finally:
        for sock in viewers:
            sock.close()


async def raw_get(port: int, path: str) -> tuple[int, bytes]:
    """One GET of ``path`` exactly as written (a client library would resolve its dot segments)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        async with asyncio.timeout(10):
            data = await reader.read()
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


async def test_only_the_page_s_own_path_serves_the_page(serve_admin):
    """A path under the prefix with dot segments, escapes or doubled slashes is answered 404, even when
    it would resolve to a route: the routes are exact paths."""
    port = await serve_admin(Admin(Config(), OwnMetrics(), lambda: 1, Pictures(10)))
    for path in ("/_specproxy", "/_specproxy/"):
        assert await raw_get(port, path) == (200, b"<html>live</html>"), path
    for path in ("/_specproxy/%2e%2e/v1/models", "/_specproxy/../v1/models", "/_specproxy/./",
                 "/_specproxy/%2e/", "/_specproxy//", "/_specproxy/x/..", "/_specproxy/events/.."):
        status, body = await raw_get(port, path)
        assert status == 404 and b"live" not in body, (path, status, body)
