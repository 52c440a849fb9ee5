"""The upstream half of the relay: HTTP/1.1 connections to the one inference server, on asyncio Protocols.

Why not aiohttp's client here: per chunk of a stream, aiohttp's client parses the chunked framing, feeds
a StreamReader and wakes the handler's task, which then writes through StreamResponse's own chunked
framing: a task switch and two framing passes per chunk, a quarter to a third of the relay's CPU
(scripts/bench_overhead.py). Here the bytes of a response body are written to the client's transport
inside ``data_received``, the moment they are read, with the upstream's framing passed through verbatim,
or handed to the relay thread (``body.py`` decides, and relays what the thread does not take).

This module owns the connection, the request and the response head; ``body.BodyRelay`` the body;
``pool.UpstreamPool`` which connection carries which exchange (and who may reuse it).

Scope, deliberately narrow: one configured origin (http or https); the request body is complete before it
is sent; one request at a time per connection (no pipelining). Response heads are parsed strictly
(``response_head.py``, llhttp), one size limit per head. Response framing per RFC 9112 6.3:
``Content-Length``, ``chunked``, or until the connection closes; HEAD, 1xx, 204 and 304 have no body;
interim 1xx responses are skipped (at most ``MAX_INTERIM`` of them, their heads inside the one head
limit). Bytes past a response's end are never relayed, and the connection that had them is not reused:
nor is one after a response with no body by rule or an interim 1xx (an upstream that disagrees may send
that body later, when the connection carries the next exchange).
Deadlines: ``connect_timeout_s`` to connect; ``idle_timeout_s`` for the response head and between reads
of the body (not while the client is the one not reading); ``send_timeout_s`` while the client is the one
not reading (no progress writing to it: the turn ends as ``client_stalled``, ``body.py``). There is no
total deadline: a long prefill or a long answer is not an error.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from specproxy.errors import UpstreamError
from specproxy.frames.chunked import ChunkedEnd, FramingError
from specproxy.wire.body import _BODY, _DONE, _IDLE, _PARKED, _WAIT_HEAD, DECHUNK, ENCODE, LOOKS, PASS, BodyRelay
from specproxy.wire.http1 import LengthEnd, UntilClose
from specproxy.wire.response_head import CHUNKED, CLOSE, LENGTH, NO_BODY, ResponseHead, parse_head
from specproxy.wire.relay_thread import no_delay

if TYPE_CHECKING:
    from specproxy.wire.pool import UpstreamPool

__all__ = [
    "CHUNKED",
    "CLOSE",
    "DECHUNK",
    "ENCODE",
    "LENGTH",
    "NO_BODY",
    "PASS",
    "ChunkedEnd",
    "FramingError",
    "ResponseHead",
    "UpstreamConn",
    "UpstreamError",
    "parse_head",
]

clock = time.perf_counter

MAX_HEAD_BYTES = 65536  # the heads of one response, interim ones included, longer than this: 502
MAX_INTERIM = 8  # more interim 1xx responses than this before the answer: 502


class UpstreamConn(BodyRelay, asyncio.Protocol):
    """One connection to the upstream, carrying one exchange at a time.

    The handler sends a request (``UpstreamPool.request``), gets the head, writes the client's response
    head, then ``attach``es the client's transport: from then on each read is forwarded from
    ``data_received``. The handler waits on ``wait()``, which returns when the body has ended (see
    ``outcome``) or when the client's transport is full (``paused``): then it waits for the client to
    drain and calls ``resume()``. The turn's builder is told of every read and of the end."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.state = _IDLE
        self._head_buf = b""
        self._head_waiter: asyncio.Future | None = None
        self.head: ResponseHead | None = None
        self.t_head = 0.0
        self._parked: list[tuple[bytes, float]] = []
        self._eof = False
        self._method = "GET"
        self.out: asyncio.Transport | None = None
        self.builder = None
        self.framing: ChunkedEnd | LengthEnd | UntilClose | None = None
        self.mode = PASS
        self.outcome: str | None = None  # "ok", "upstream_truncated", "client_abort" once finished
        self.error: str | None = None
        self.paused = False
        self._waiter: asyncio.Future | None = None
        self._high = 65536
        self.last_read = 0.0
        self._took = 0  # how far the client had taken the body at the last look (body._taken)
        self._took_at = 0.0  # and when it was last seen taking more
        self._timer: asyncio.TimerHandle | None = None
        self._pool_timer: asyncio.TimerHandle | None = None
        self.reusable = True
        self._turn = None  # the body's _relayc.Turn while the relay thread has it
        self.exchanges = 0  # requests sent on this connection: names the exchange a handler is part of
        self.owner: asyncio.BaseTransport | None = None  # the client connection of its latest exchange
        self._head_seen = 0  # bytes of this exchange's interim heads
        self._interim = 0
        self.unanswered = False  # closed by the upstream while waiting for a head, before any byte of it

    # --- asyncio callbacks ----------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        no_delay(transport)

    def data_received(self, data: bytes) -> None:
        t_read = clock()
        self.last_read = t_read
        self.pool.last_read = t_read  # the measuring worker waits for a gap in these
        state = self.state
        if state == _BODY:
            self._body(data, t_read)
        elif state == _WAIT_HEAD:
            self._on_head_bytes(data, t_read)
        elif state == _PARKED:
            self._parked.append((data, t_read))
        else:  # bytes nobody asked for: this connection cannot be trusted with another exchange
            self.reusable = False
            self.transport.close()

    def eof_received(self) -> bool:
        return False  # close our side too: HTTP/1.1 has no half-closed exchanges

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None
        self.reusable = False
        self._cancel_timer()
        if self._pool_timer is not None:
            self._pool_timer.cancel()
        self.pool._forget(self)
        state = self.state
        if state == _WAIT_HEAD:
            self.unanswered = not self._head_buf  # not one byte of a response: the request may not have been read
            why = f"the upstream closed the connection before responding ({type(exc).__name__})" if exc else \
                "the upstream closed the connection before responding"
            self._fail_head(UpstreamError(why))
        elif state == _PARKED:
            self._eof = True
        elif state == _BODY:
            if isinstance(self.framing, UntilClose):
                self._complete("ok", None)
            else:
                reason = f"{type(exc).__name__}: connection lost" if exc else "the upstream closed the connection"
                self._truncated(f"body incomplete: {reason}")

    def pause_writing(self) -> None:  # our request is large and the upstream is slow to read it
        pass

    def resume_writing(self) -> None:
        pass

    # --- sending and the head -----------------------------------------------------------------------------

    def send(self, method: str, data: bytes | tuple[bytes, bytes]) -> asyncio.Future:
        assert self.state == _IDLE and self.transport is not None
        if self._pool_timer is not None:
            self._pool_timer.cancel()
            self._pool_timer = None
        self._method = method
        self.exchanges += 1
        self._head_seen = self._interim = 0
        self.state = _WAIT_HEAD
        self._head_waiter = self.pool.loop.create_future()
        if type(data) is tuple:  # (head, a large body): written without joining them (a copy of the body)
            self.transport.writelines(data)
        else:
            self.transport.write(data)
        self.last_read = clock()
        self._arm_timer()
        return self._head_waiter

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
            self.state = _PARKED
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
        self.state = _DONE
        self.reusable = False
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def abandon(self, outcome: str, reason: str, exchange: int | None = None) -> None:
        """The handler is going away (the client hung up, or a bug): end the exchange, drop the connection.

        ``exchange`` (``exchanges`` when the handler's request was sent): when that exchange is over and the
        connection already serves another handler's (it went back to the pool as this handler was being
        cancelled), there is nothing of this handler's left to end."""
        if exchange is not None and exchange != self.exchanges:
            return
        if self._thread_ended_first():
            return  # the body had ended: the connection is as good as after any other exchange
        if self.state == _WAIT_HEAD:
            self._fail_head(UpstreamError(reason))
        if self.state != _DONE:
            self.reusable = False
            self._complete(outcome, reason)
        self.close()

    # --- deadlines and closing ----------------------------------------------------------------------

    def _arm_timer(self, delay: float | None = None) -> None:
        self._cancel_timer()
        self._timer = self.pool.loop.call_later(self.pool.idle_timeout_s if delay is None else delay,
                                                self._check_idle)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_idle(self) -> None:
        """One timer per idle period, not per read: re-armed for what is left when bytes came meanwhile.
        While the client is what holds the body back, its send deadline instead (``_send_left``)."""
        self._timer = None
        now = clock()
        left = self._send_left(now)
        if left is not None:
            if left > 0:
                self._timer = self.pool.loop.call_later(left, self._check_idle)
            return
        turn = self._turn
        if turn is not None:  # the thread's reads
            self.last_read = max(self.last_read, turn.last_activity)
        left = self.last_read + self.pool.idle_timeout_s - now
        if left > 0:
            if turn is not None:  # soon enough to see the client hold the thread back (send_timeout_s)
                left = min(left, self.pool.send_timeout_s / LOOKS)
            self._timer = self.pool.loop.call_later(left, self._check_idle)
            return
        limit = f"idle_timeout_s ({self.pool.idle_timeout_s:g} s)"
        if self.state == _WAIT_HEAD:
            self._fail_head(UpstreamError(f"no response head within {limit}", timeout=True))
            self.close()
        elif self.state == _BODY and not self.paused:
            self._truncated(f"no byte from the upstream within {limit}")

    def close(self) -> None:
        self.reusable = False
        self._thread_detach()  # the thread lets go of the sockets before they close
        if self.transport is not None:
            self.transport.close()
