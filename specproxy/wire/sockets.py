"""What the wire asks of a socket under an asyncio transport: its descriptor, TCP_NODELAY, and how far
the peer has taken our bytes.

Why apart: the pool, the connection, both relays and the exchange each need one of these, and none of
them should import another for it.
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import sys
import termios

__all__ = ["acked_bytes", "no_delay", "owed", "plain_socket_fd", "reference_acked", "taken"]


def plain_socket_fd(transport: asyncio.BaseTransport) -> int | None:
    """The descriptor under a transport, if its bytes are the wire's (no TLS in between); else None."""
    if transport.get_extra_info("sslcontext") is not None or transport.get_extra_info("ssl_object") is not None:
        return None
    sock = transport.get_extra_info("socket")
    if sock is None:
        return None
    fd = sock.fileno()
    return fd if fd >= 0 else None


# the figure read natively: no socket object made around the descriptor, no address asked (once a turn;
# docs/performance.md, "Design figures")
try:
    from specproxy.wire._relayc import tcp_acked as _native_acked
except ImportError:  # without a compiler: the reference, reference_acked
    _native_acked = None

_TCP_INFO = getattr(socket, "TCP_INFO", None)
_ACKED = slice(120, 128)  # struct tcp_info's tcpi_bytes_acked (Linux >= 4.1), a u64 in the host's byte order


def acked_bytes(transport: asyncio.BaseTransport) -> int | None:
    """Bytes of ours the peer's TCP has acknowledged on this connection: it goes up as the peer reads
    (its window opens), and stays put while it does not. None where the kernel does not say.

    Why not the writes we manage: the kernel reports a full socket writable again only once half of its
    send queue (megabytes, autotuned) has gone, so a client reading slowly but steadily would look
    stalled for many seconds between two writes."""
    sock = transport.get_extra_info("socket")
    if sock is None or _TCP_INFO is None:
        return None
    if _native_acked is None:
        return reference_acked(sock)
    try:
        return _native_acked(sock.fileno())
    except OSError:
        return None


def reference_acked(sock: socket.socket) -> int | None:
    """``acked_bytes`` of a socket, read through Python's socket object (the reference of the native read:
    an asyncio transport's socket makes a ``socket.socket`` around its descriptor for each call)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 232)
    except (OSError, AttributeError):
        return None
    return int.from_bytes(info[_ACKED], sys.byteorder) if len(info) >= _ACKED.stop else None


def taken(out: asyncio.BaseTransport) -> int:
    """How far the client has taken the response: the bytes its TCP acknowledged, or (where the kernel
    does not say) minus what waits in our buffer for it. Goes up exactly when the client takes bytes."""
    acked = acked_bytes(out)
    return acked if acked is not None else -out.get_write_buffer_size()


_OUTQ = getattr(termios, "TIOCOUTQ", None)  # SIOCOUTQ on a TCP socket: bytes written and not yet acknowledged


def owed(out: asyncio.BaseTransport) -> bool:
    """Bytes of ours wait for the client: in our buffer, or in the kernel's send queue unacknowledged.

    Why the kernel's queue too: a client that stopped reading holds the thread's writes back only once
    the kernel's send buffer is full; before that (or when the kernel's own TCP memory is short and the
    upstream's bytes stop coming as well) the thread waits on the upstream, and the client's silence shows
    only as bytes it never acknowledges."""
    if out.get_write_buffer_size():
        return True
    sock = out.get_extra_info("socket")
    if sock is None or _OUTQ is None:
        return False
    try:
        queued = fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0")
    except (OSError, ValueError):
        return False
    return struct.unpack("i", queued)[0] > 0


def no_delay(transport: asyncio.BaseTransport) -> None:
    """TCP_NODELAY on the socket under a transport: a token must not wait for Nagle's algorithm."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
