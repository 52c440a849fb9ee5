"""The pool's look at an idle connection before lending it (``wire/pool.py`` ``_pending``), case by case.

Why white-box: the behaviour tests (``test_faults_response.py``) see a connection with bytes waiting
skipped at checkout, but the bytes almost always reach the loop first, which drops the connection before
the look; the look itself decides only for bytes, an end of file or a reset that arrive in the same loop
turn as the checkout. Here each case is put on a real socket on 127.0.0.1 and looked at directly.
"""

from __future__ import annotations

import asyncio
import select
import socket
import struct

from specproxy.wire.pool import _pending
from specproxy.wire.sockets import plain_socket_fd


class _Quiet(asyncio.Protocol):
    """Reads nothing itself: the test pauses the transport so that whatever comes stays in the socket."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.pause_reading()


async def _pair() -> tuple[asyncio.Transport, socket.socket, socket.socket]:
    """A client transport on the loop and the server's end of its connection, a plain blocking socket (the
    only descriptor of that end: closing it closes the connection)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    transport, _ = await asyncio.get_running_loop().create_connection(_Quiet, "127.0.0.1", port)
    listener.settimeout(5)
    peer, _ = listener.accept()  # the handshake is done: it waits in the backlog
    peer.settimeout(None)
    return transport, peer, listener


async def _until(transport: asyncio.Transport, poller: select.poll, want: bool) -> bool:
    """The look's answer once what the peer did has arrived (loopback: within a few loop turns)."""
    for _ in range(200):  # bounded: loopback delivers within microseconds
        if _pending(plain_socket_fd(transport), poller) == want:  # the descriptor, as the connection keeps it
            return want
        await asyncio.sleep(0.005)
    return not want


async def test_an_idle_connection_is_lent_and_one_with_bytes_an_eof_or_a_reset_is_not() -> None:
    poller = select.poll()
    cases = []
    for what in ("idle", "bytes", "eof", "reset"):
        transport, peer, listener = await _pair()
        try:
            if what == "bytes":
                peer.sendall(b"HTTP/1.1 200 OK\r\n")
            elif what == "eof":
                peer.shutdown(socket.SHUT_WR)
            elif what == "reset":
                peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                peer.close()
            cases.append((what, await _until(transport, poller, what != "idle")))
        finally:
            transport.abort()
            if peer.fileno() >= 0:
                peer.close()
            listener.close()
    assert cases == [("idle", False), ("bytes", True), ("eof", True), ("reset", True)]
