"""The event loop's side of the relay thread (``_relayc.Turn``/``Sink``, see ``_pump.c``).

Why a thread: relayed on the event loop, even in C, each read costs uvloop's callbacks under the
interpreter lock and objects per read, several times nginx's CPU per chunk (docs/performance.md). Once a response's head is out and its body is a chunked stream
passed through, ``UpstreamConn`` hands the body to one native thread that never takes the interpreter
lock: it reads, finds the end, sends, stamps and keeps each read; the loop hears back once per turn.

``TurnSink`` is one loop's mailbox: it starts turns, and when the thread has ended some (the body's end,
a framing error, a closed upstream, a client gone) it calls each connection's ``_thread_ended`` on the
loop. Everything else (the idle deadline, the client hanging up, closing) ends a turn from the loop with
``Turn.cancel()``, after which the thread touches neither socket.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specproxy.wire.upstream import UpstreamConn

__all__ = ["THREAD_BUILT", "NativeChunkedEnd", "TurnSink", "acked_bytes", "ended_reason", "last_read",
           "plain_socket_fd"]

log = logging.getLogger("specproxy.relay")

try:
    from specproxy.wire import _relayc
except ImportError:  # without a compiler there is no thread: every body is relayed in Python
    _relayc = None

THREAD_BUILT = _relayc is not None
# _chunked.h's parser: the framing of a body the thread may take (Turn starts from its state)
NativeChunkedEnd = _relayc.ChunkedEnd if _relayc is not None else None


def last_read() -> float:
    """The thread's latest read of any turn (``perf_counter`` seconds; 0.0 before the first)."""
    return _relayc.pump_last_read() if _relayc is not None else 0.0


def plain_socket_fd(transport: asyncio.BaseTransport) -> int | None:
    """The descriptor under a transport, if its bytes are the wire's (no TLS in between); else None."""
    if transport.get_extra_info("sslcontext") is not None or transport.get_extra_info("ssl_object") is not None:
        return None
    sock = transport.get_extra_info("socket")
    if sock is None:
        return None
    fd = sock.fileno()
    return fd if fd >= 0 else None


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
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 232)
    except (OSError, AttributeError):
        return None
    return int.from_bytes(info[_ACKED], sys.byteorder) if len(info) >= _ACKED.stop else None


def no_delay(transport: asyncio.BaseTransport) -> None:
    """TCP_NODELAY on the socket under a transport: a token must not wait for Nagle's algorithm."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


class TurnSink:
    """The turns one event loop handed to the relay thread; ended ones come back through an eventfd."""

    def __init__(self, loop: asyncio.AbstractEventLoop, slice_us: int) -> None:
        self.loop = loop
        self._sink = _relayc.Sink(slice_us)  # the thread's scheduler slice, if this loop's turn starts it
        self._conns: dict[int, UpstreamConn] = {}
        self._fd = self._sink.fileno()
        loop.add_reader(self._fd, self._collect)
        self.closed = False
        self.started = 0  # turns handed to the thread: tests read it to know the thread took a body

    def start(self, conn: UpstreamConn, upstream_fd: int, client_fd: int, framing: Any, keep: int):
        """The thread relays the body from now on, keeping its first reads within ``keep`` bytes for
        measuring. Raises OSError (no descriptor left, no thread)."""
        turn = _relayc.Turn(self._sink, upstream_fd, client_fd, framing, keep)
        self._conns[turn.id] = conn
        self.started += 1
        return turn

    def forget(self, turn) -> None:
        self._conns.pop(turn.id, None)

    def _collect(self) -> None:
        for turn_id in self._sink.done():
            conn = self._conns.pop(turn_id, None)
            if conn is None:  # the loop had cancelled it meanwhile
                continue
            try:
                conn._thread_ended()
            except Exception as exc:  # a bug: the other turns of this report must still end
                log.error("ending a relayed turn failed: %s", type(exc).__name__)
                conn.abandon("proxy_error", f"{type(exc).__name__} while ending the turn")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self._fd)


def ended_reason(outcome: tuple[str, int, str | None]) -> tuple[str, str | None]:
    """What a turn the thread ended means to ``UpstreamConn``: ("ok"|"truncated"|"client_gone", reason), in
    the words the Python relay uses for the same event."""
    name, err, framing = outcome
    if name == "end":
        return "ok", None
    if name == "framing":
        return "truncated", f"malformed chunked framing from the upstream ({framing})"
    if name == "upstream_eof":
        return "truncated", "body incomplete: the upstream closed the connection"
    if name == "upstream_error":
        return "truncated", f"body incomplete: {type(OSError(err, os.strerror(err))).__name__}: connection lost"
    if name == "client_gone":
        return "client_gone", "client disconnected"
    why = os.strerror(err) if err else name  # "thread_error": out of memory, or epoll refused the socket
    return "truncated", f"the relay thread could not go on ({why})"
