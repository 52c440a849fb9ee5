"""Raw-socket peers for behaviour that a well-behaved HTTP library will not produce: an upstream that
dies mid-stream or holds the connection after [DONE], a client that hangs up at a chosen moment.

Every wait has a deadline; servers bind 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class RawUpstream:
    """A TCP server on 127.0.0.1 that runs ``script(reader, writer)`` per connection.

    ``connections`` counts accepted connections; ``closed`` is set each time a connection's peer
    (the proxy) closes it, which is how tests see that the proxy let go of the upstream.
    """

    def __init__(self, script: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]) -> None:
        self.script = script
        self.connections = 0
        self.peer_closed = asyncio.Event()
        self.requests: list[bytes] = []
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> RawUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.script(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """Read one HTTP/1.1 request with a Content-Length body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    body = await asyncio.wait_for(reader.readexactly(length), 10) if length else b""
    return head + body


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: keep-alive\r\n\r\n")


async def wait_closed(reader: asyncio.StreamReader, timeout: float) -> float | None:
    """Wait until the peer closes; return seconds waited, or None when it did not within ``timeout``."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        while True:
            data = await asyncio.wait_for(reader.read(65536), max(timeout - (loop.time() - t0), 0.001))
            if not data:
                return loop.time() - t0
    except (asyncio.TimeoutError, TimeoutError):
        return None
    except ConnectionError:
        return loop.time() - t0
