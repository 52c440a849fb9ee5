"""One HTTP/1.1 connection to the upstream, on an asyncio Protocol: it sends a request and reads the
response head; the body's reads go to whoever the exchange named (``start_body``).

Why not aiohttp's client here: per chunk of a stream, aiohttp's client parses the chunked framing, feeds
a StreamReader and wakes the handler's task, which then writes through StreamResponse's own chunked
framing: a task switch and two framing passes per chunk, a quarter to a third of the relay's CPU
(scripts/bench_overhead.py). Here the bytes of a response body are handed on inside ``data_received``,
the moment they are read (to ``relay.PythonRelay``), or the relay thread reads the socket itself.

This module owns the connection, its state (``ConnState``), the request and the response head;
``exchange.Exchange`` one request's exchange over it; ``pool.UpstreamPool`` which connection carries
which exchange (and who may reuse it).

Scope, deliberately narrow: one configured origin (http or https); the request body is complete before it
is sent; one request at a time per connection (no pipelining). Response heads are parsed strictly
(``response_head.py``, llhttp), one size limit per head. Response framing per RFC 9112 6.3:
``Content-Length``, ``chunked``, or until the connection closes; HEAD, 1xx, 204 and 304 have no body;
interim 1xx responses are skipped (at most ``MAX_INTERIM`` of them, their heads inside the one head
limit). Bytes past a response's end are never relayed, and the connection that had them is not reused:
nor is one after a response with no body by rule or an interim 1xx (an upstream that disagrees may send
that body later, when the connection carries the next exchange). Deadline here: ``idle_timeout_s`` for
the response head (the body's are the exchange's).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from typing import Protocol

from specproxy.errors import UpstreamError
from specproxy.frames.chunked import ChunkedEnd, FramingError
from specproxy.wire.relay import DECHUNK, ENCODE, PASS
from specproxy.wire.response_head import CHUNKED, CLOSE, LENGTH, NO_BODY, ResponseHead, parse_head
from specproxy.wire.sockets import no_delay, plain_socket_fd

__all__ = [
    "CHUNKED",
    "CLOSE",
    "DECHUNK",
    "ENCODE",
    "LENGTH",
    "NO_BODY",
    "PASS",
    "ChunkedEnd",
    "ConnState",
    "FramingError",
    "ResponseHead",
    "UpstreamConn",
    "UpstreamError",
    "parse_head",
]

clock = time.perf_counter

MAX_HEAD_BYTES = 65536  # the heads of one response, interim ones included, longer than this: 502
MAX_INTERIM = 8  # more interim 1xx responses than this before the answer: 502


class ConnState(enum.IntEnum):
    """Where a connection is in its exchange; only the connection changes it."""

    IDLE = 0  # in the pool, or new: may send a request
    WAIT_HEAD = 1  # a request sent, its response head not yet in
    PARKED = 2  # the head is in; reads of the body wait for the exchange to start it
    BODY = 3  # the body's reads go to the exchange's reader
    DONE = 4  # the exchange ended; back to IDLE only through the pool


IDLE, WAIT_HEAD, PARKED, BODY, DONE = ConnState


class ConnHome(Protocol):
    """What a connection needs of the pool that made it (``pool.UpstreamPool``)."""

    loop: asyncio.AbstractEventLoop
    idle_timeout_s: float
    last_read: float  # the latest read on the loop, any connection: the measuring worker waits for a gap

    def discard(self, conn: UpstreamConn) -> None:
        """The connection is closed or closing: forget it."""


class UpstreamConn(asyncio.Protocol):
    """One connection to the upstream, carrying one exchange at a time.

    ``send`` a request and await its head; then ``start_body`` says which reads came meanwhile and whom to
    tell if the connection goes during the body, and ``read_to`` names who gets its reads on the loop (none
    while the relay thread reads the socket)."""

    def __init__(self, home: ConnHome) -> None:
        self.home = home
        self.transport: asyncio.Transport | None = None
        self.fd: int | None = None  # the socket's descriptor, where the transport's bytes are the wire's (no TLS)
        self.state = IDLE
        self._head_buf = b""
        self._head_waiter: asyncio.Future | None = None
        self.head: ResponseHead | None = None
        self.t_head = 0.0
        self._parked: list[tuple[bytes, float]] = []
        self._eof = False
        self._method = "GET"
        self._reader: Callable[[bytes, float], None] | None = None
        self._lost: Callable[[BaseException | None], None] | None = None
        self._letgo: Callable[[], None] | None = None  # the body's relay lets go of the sockets, before a close
        self._timer: asyncio.TimerHandle | None = None
        self.last_read = 0.0
        self.reusable = True  # False once anything makes the connection untrustworthy for another exchange
        self.exchanges = 0  # requests sent on this connection
        self.owner: asyncio.BaseTransport | None = None  # the client connection of its latest exchange
        self.idle_since = 0.0  # when it last went back to the pool (``make_idle``; perf_counter)
        self._head_seen = 0  # bytes of this exchange's interim heads
        self._interim = 0
        self.unanswered = False  # closed by the upstream while waiting for a head, before any byte of it

    # --- asyncio callbacks ----------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.fd = plain_socket_fd(transport)
        no_delay(transport)

    def data_received(self, data: bytes) -> None:
        t_read = clock()
        self.last_read = t_read
        self.home.last_read = t_read
        state = self.state
        if state is BODY:
            self._reader(data, t_read)
        elif state is WAIT_HEAD:
            self._on_head_bytes(data, t_read)
        elif state is PARKED:
            self._parked.append((data, t_read))
        else:
            self._stray(data, t_read)

    def _stray(self, data: bytes, t_read: float) -> None:
        """Bytes nobody asked for: this connection cannot be trusted with another exchange."""
        self.reusable = False
        self.transport.close()

    def eof_received(self) -> bool:
        return False  # close our side too: HTTP/1.1 has no half-closed exchanges

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None
        self.fd = None  # the number may name another socket from now on
        self.reusable = False
        self._cancel_timer()
        state = self.state
        if state is WAIT_HEAD:
            self.unanswered = not self._head_buf  # not one byte of a response: the request may not have been read
            why = f"the upstream closed the connection before responding ({type(exc).__name__})" if exc else \
                "the upstream closed the connection before responding"
            self._fail_head(UpstreamError(why))
        elif state is PARKED:
            self._eof = True
        elif state is BODY:
            self._lost(exc)  # before the pool hears: a turn the relay thread had ended stays as it ended
        self.home.discard(self)

    def pause_writing(self) -> None:  # our request is large and the upstream is slow to read it
        pass

    def resume_writing(self) -> None:
        pass

    # --- one exchange: the request, the head, the body ----------------------------------------------

    def send(self, method: str, data: bytes | tuple[bytes, bytes]) -> asyncio.Future:
        """Send a request (or a tuple of its head and a large body, written without joining them): a
        future of its response head (raises ``UpstreamError``)."""
        assert self.state is IDLE and self.transport is not None
        self._method = method
        self.exchanges += 1
        self._head_seen = self._interim = 0
        self.state = WAIT_HEAD
        self._head_waiter = self.home.loop.create_future()
        if type(data) is tuple:
            self.transport.writelines(data)
        else:
            self.transport.write(data)
        self.last_read = clock()
        self._arm_timer()
        return self._head_waiter

    def start_body(self, lost: Callable[[BaseException | None], None],
                   letgo: Callable[[], None]) -> tuple[list[tuple[bytes, float]], bool]:
        """The body begins: a lost connection goes to ``lost`` from now on, and ``letgo`` is called before the
        connection is closed (the relay thread lets go of the sockets first). Returns the reads that came
        with or after the head (with their times) and whether the upstream has closed. Reads on the loop
        go nowhere until ``read_to`` names their reader."""
        assert self.state is PARKED and self.head is not None
        self.state = BODY
        self._reader = self._stray
        self._lost = lost
        self._letgo = letgo
        parked, self._parked = self._parked, []
        return parked, self._eof

    def read_to(self, reader: Callable[[bytes, float], None]) -> None:
        """Each read of the body on the loop goes to ``reader`` (the loop's relay) from now on."""
        self._reader = reader

    def end_body(self) -> None:
        """The exchange ended: no read goes anywhere until the pool makes the connection idle again."""
        self.state = DONE
        self._reader = self._lost = self._letgo = None

    def make_idle(self) -> None:
        """Back in the pool after an exchange: ready for the next request."""
        self.state = IDLE
        self.idle_since = clock()  # the pool's sweep closes it POOL_IDLE_S from here
        self.head = None
        self._parked = []
        self._eof = False

    def forbid_reuse(self) -> None:
        self.reusable = False

    def _on_head_bytes(self, data: bytes, t_read: float) -> None:
        """Bytes of the response head. One size limit for the heads of a response (interim ones included),
        however the reads cut them; a head that is not strict HTTP/1.1 (``response_head.parse_head``) gets
        the client a 502."""
        buf = self._head_buf + data if self._head_buf else data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if self._head_seen + len(buf) > MAX_HEAD_BYTES:
                    self._refuse_head(UpstreamError(f"response head over {MAX_HEAD_BYTES} bytes from the upstream"))
                    return
                if b"\n\n" in buf or b"\n\r\n" in buf:
                    # a blank line after a bare LF: never a head we take; say so now, not at the deadline
                    self._refuse_head(UpstreamError("malformed response head from the upstream (bare LF)"))
                    return
                self._head_buf = buf
                return
            end += 4
            if self._head_seen + end > MAX_HEAD_BYTES:
                self._refuse_head(UpstreamError(f"response head over {MAX_HEAD_BYTES} bytes from the upstream"))
                return
            try:
                head = parse_head(buf[:end], self._method)
            except UpstreamError as exc:
                self._refuse_head(exc)
                return
            rest = buf[end:]
            if 100 <= head.status < 200:
                if head.status == 101:
                    self._refuse_head(UpstreamError("the upstream switched protocols, which a proxy of HTTP "
                                                    "exchanges cannot relay"))
                    return
                # an interim response (100 Continue, 103 Early Hints): not the answer. Nor a connection to
                # reuse: an upstream that gave it a body would leave that body to the next exchange.
                self.reusable = False
                self._head_seen += end
                self._interim += 1
                if self._interim > MAX_INTERIM:
                    self._refuse_head(UpstreamError(f"more than {MAX_INTERIM} interim responses from the upstream"))
                    return
                buf = rest
                continue
            if head.framing == NO_BODY:
                # no body by rule (HEAD, 204, 304): an upstream that sends one anyway, even much later, must
                # not have it read as the answer to another client's request on this connection
                self.reusable = False
            self._head_buf = b""
            self.head = head
            self.t_head = t_read
            self.state = PARKED
            self._cancel_timer()
            if rest:
                self._parked.append((rest, t_read))
            waiter = self._head_waiter
            self._head_waiter = None
            if waiter is not None and not waiter.done():
                waiter.set_result(head)
            return

    def _refuse_head(self, exc: UpstreamError) -> None:
        self._fail_head(exc)
        self.close()

    def _fail_head(self, exc: UpstreamError) -> None:
        self._cancel_timer()
        waiter = self._head_waiter
        self._head_waiter = None
        self.state = DONE
        self.reusable = False
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def fail_head(self, reason: str) -> None:
        """The exchange is going away while its head is awaited: fail the wait, and the connection."""
        if self.state is WAIT_HEAD:
            self._fail_head(UpstreamError(reason))
        self.close()

    # --- the head's deadline, and closing -----------------------------------------------------------

    def _arm_timer(self) -> None:
        self._cancel_timer()
        self._timer = self.home.loop.call_later(self.home.idle_timeout_s, self._check_head)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_head(self) -> None:
        """One timer for the head's wait, re-armed for what is left when bytes of it came meanwhile."""
        self._timer = None
        if self.state is not WAIT_HEAD:
            return
        left = self.last_read + self.home.idle_timeout_s - clock()
        if left > 0:
            self._timer = self.home.loop.call_later(left, self._check_head)
            return
        self._fail_head(UpstreamError(f"no response head within idle_timeout_s ({self.home.idle_timeout_s:g} s)",
                                      timeout=True))
        self.close()

    def close(self) -> None:
        self.reusable = False
        self._cancel_timer()
        letgo, self._letgo = self._letgo, None
        if letgo is not None:
            letgo()
        if self.transport is not None:
            self.transport.close()
