"""``wire/sockets.acked_bytes``: the native read of a client's progress (``_relayc.tcp_acked``) against its
Python reference (``reference_acked``), on real loopback connections under uvloop's transports.

Why held equal: the exchange reads it once a turn (``taken``) to tell a client that holds the body back
from one that reads slowly; the two reads must give the same figure at every moment, the native one
without the socket object the reference builds around the descriptor.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import uvloop

from specproxy.wire import sockets

needs_native = pytest.mark.skipif(sockets._native_acked is None, reason="specproxy.wire._relayc is not built")


async def _acked_reaches(transport: asyncio.Transport, n: int, timeout: float = 10.0) -> int:
    """The peer's TCP acknowledges what its kernel received; wait (bounded) until the figure reaches ``n``."""
    deadline = time.monotonic() + timeout
    while True:
        acked = sockets.acked_bytes(transport)
        if acked is not None and acked >= n or time.monotonic() > deadline:
            return acked
        await asyncio.sleep(0.001)


def _between(transport: asyncio.Transport) -> tuple[int, int, int]:
    """Native, reference, native: the figure only grows, so while acknowledgements still come in a right
    reference lies between the two native reads around it."""
    first = sockets.acked_bytes(transport)
    reference = sockets.reference_acked(transport.get_extra_info("socket"))
    return first, reference, sockets.acked_bytes(transport)


def _both(transport: asyncio.Transport) -> tuple[int | None, int | None]:
    return sockets.acked_bytes(transport), sockets.reference_acked(transport.get_extra_info("socket"))


async def _connected():
    """A uvloop transport to a listening socket of ours that reads only when told (``peer``)."""
    server = socket.create_server(("127.0.0.1", 0))
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_connection(asyncio.Protocol, *server.getsockname())
    peer, _ = server.accept()
    server.close()
    return transport, peer


@needs_native
def test_the_native_read_equals_the_reference_as_the_peer_reads():
    async def main():
        transport, peer = await _connected()
        try:
            sent = 1000
            transport.write(b"x" * sent)
            acked = await _acked_reaches(transport, sent)
            assert acked is not None and acked >= sent
            assert _both(transport) == (acked, acked)
            # more than the peer's window while it does not read: the figure stops short of what was sent,
            # and moves again only as the peer's kernel makes room (both reads say where it is)
            peer.setblocking(False)
            big = 64 << 20  # past the receive buffer (tcp_rmem allows up to 32 MiB here)
            transport.write(b"y" * big)
            for _ in range(3):
                await asyncio.sleep(0.02)
                first, reference, last = _between(transport)
                assert first <= reference <= last < sent + big
            got = 0
            deadline = time.monotonic() + 30
            while got < sent + big and time.monotonic() < deadline:  # the peer takes it all
                try:
                    got += len(peer.recv(1 << 20))
                except BlockingIOError:
                    await asyncio.sleep(0.001)
            assert got == sent + big
            acked = await _acked_reaches(transport, sent + big)  # all of it acknowledged: nothing moves now
            assert acked >= sent + big
            assert _both(transport) == (acked, acked)
        finally:
            transport.abort()
            peer.close()

    uvloop.run(main())


def test_the_reference_alone_gives_the_figure(monkeypatch):
    """Without the compiled module ``acked_bytes`` is the reference: the same figure."""
    async def main():
        transport, peer = await _connected()
        try:
            transport.write(b"x" * 500)
            acked = await _acked_reaches(transport, 500)
            monkeypatch.setattr(sockets, "_native_acked", None)
            assert sockets.acked_bytes(transport) == acked >= 500
        finally:
            transport.abort()
            peer.close()

    uvloop.run(main())


@needs_native
def test_a_descriptor_that_is_not_a_tcp_socket_reads_as_an_error_not_a_figure():
    with pytest.raises(OSError):
        sockets._native_acked(-1)
    r, w = socket.socketpair()  # a Unix socket: TCP_INFO does not apply
    try:
        with pytest.raises(OSError):
            sockets._native_acked(r.fileno())
        assert sockets.reference_acked(r) is None
    finally:
        r.close()
        w.close()
