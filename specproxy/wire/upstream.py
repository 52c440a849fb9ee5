"""The upstream half of the relay: HTTP/1.1 connections to the one inference server, on asyncio Protocols.

Why not aiohttp's client here: per chunk of a stream, aiohttp's client parses the chunked framing, feeds
a StreamReader and wakes the handler's task, which then writes through StreamResponse's own chunked
framing: a task switch and two framing passes per chunk, a quarter to a third of the relay's CPU
(scripts/bench_overhead.py). Here the bytes of a response body are written to the client's transport
inside ``data_received``, the moment they are read, with the upstream's framing passed through verbatim,
or handed to the relay thread (``body.py`` decides, and relays what the thread does not take).

This module owns the connection, the request and the response head; ``body.BodyRelay`` the body.

Scope, deliberately narrow: one configured origin (http or https); the request body is complete before it
is sent; one request at a time per connection (no pipelining); idle connections are reused newest first
and closed after ``POOL_IDLE_S``. A connection that has carried an exchange is private to the client
connection it served (its ``owner``, as HAProxy's private connections): only that client's next request
reuses it, and it is closed once that client has gone (at release, or by a sweep every ``SWEEP_S``).
Why: bytes an upstream sends after a response it framed wrongly (or past its end, in a later segment)
cannot be told from the answer to the next request on that connection, by any proxy; kept per client,
they can confuse at most the client whose own exchange the upstream misframed, never another. A fresh
connection that never carried an exchange (start-up's probe) may go to anyone. A request is sent twice
only when a connection kept alive after an exchange is closed by the upstream before one byte of the
next answer (its close raced our send): once more, on a new connection, never a third time; nothing else
is retried. Response heads are parsed strictly
(``response_head.py``, llhttp), one size limit per head. Response framing per RFC 9112 6.3:
``Content-Length``, ``chunked``, or until the connection closes; HEAD, 1xx, 204 and 304 have no body;
interim 1xx responses are skipped (at most ``MAX_INTERIM`` of them, their heads inside the one head
limit). Bytes past a response's end are never relayed, and the connection that had them is not reused:
nor is one after a response with no body by rule or an interim 1xx (an upstream that disagrees may send
that body later, when the connection carries the next exchange), nor an idle one with bytes waiting or
closed when it is taken from the pool (a peek; a TLS connection is not peeked).
Deadlines: ``connect_timeout_s`` to connect; ``idle_timeout_s`` for the response head and between reads
of the body (not while the client is the one not reading). There is no total deadline: a long prefill or
a long answer is not an error.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import time

from yarl import URL

from specproxy.errors import UpstreamError
from specproxy.frames.chunked import ChunkedEnd, FramingError
from specproxy.wire.body import _BODY, _DONE, _IDLE, _PARKED, _WAIT_HEAD, DECHUNK, ENCODE, PASS, BodyRelay
from specproxy.wire.http1 import LengthEnd, UntilClose
from specproxy.wire.response_head import CHUNKED, CLOSE, LENGTH, NO_BODY, ResponseHead, parse_head
from specproxy.wire.relay_thread import THREAD_BUILT, TurnSink, no_delay, plain_socket_fd
from specproxy.wire.relay_thread import last_read as thread_last_read

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
    "UpstreamPool",
    "parse_head",
]

clock = time.perf_counter

POOL_IDLE_S = 15.0  # an idle kept-alive connection is closed after this long
SWEEP_S = 1.0  # how often idle connections kept for client connections are checked for their client gone
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

    def send(self, method: str, data: bytes) -> asyncio.Future:
        assert self.state == _IDLE and self.transport is not None
        if self._pool_timer is not None:
            self._pool_timer.cancel()
            self._pool_timer = None
        self._method = method
        self.exchanges += 1
        self._head_seen = self._interim = 0
        self.state = _WAIT_HEAD
        self._head_waiter = self.pool.loop.create_future()
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

    def _arm_timer(self) -> None:
        self._cancel_timer()
        self._timer = self.pool.loop.call_later(self.pool.idle_timeout_s, self._check_idle)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_idle(self) -> None:
        """One timer per idle period, not per read: re-armed for what is left when bytes came meanwhile."""
        self._timer = None
        turn = self._turn
        if turn is not None:  # the thread's reads, or now if the client is what holds the body back
            self.last_read = clock() if turn.blocked else max(self.last_read, turn.last_activity)
        left = self.last_read + self.pool.idle_timeout_s - clock()
        if left > 0:
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


def _pending(transport: asyncio.Transport) -> bool:
    """Whether the socket under an idle connection has bytes waiting, or its end of file (a peek that
    never blocks). A TLS connection is not peeked: its records are not the exchange's bytes."""
    fd = plain_socket_fd(transport)
    if fd is None:
        return False
    # a socket object over the transport's own descriptor, let go of (never closed) after one peek:
    # family and type given, so that making it costs no system call
    peek = socket.socket(transport.get_extra_info("socket").family, socket.SOCK_STREAM, fileno=fd)
    try:
        peek.settimeout(0)  # non-blocking already (the transport's): say so to Python
        peek.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return False  # nothing waits: the connection is as the last exchange left it
    except OSError:
        return True  # reset: not one to send on
    finally:
        peek.detach()
    return True


class UpstreamPool:
    """Connections to the one upstream origin, kept alive between exchanges: each one that has carried an
    exchange for the client connection that exchange came from, the fresh ones for anyone."""

    def __init__(self, url: URL, *, connect_timeout_s: float, idle_timeout_s: float, relay: str = "thread",
                 relay_slice_us: int = 100) -> None:
        """``relay``: ``thread`` (a chunked body passed through goes to the relay thread where it can) or
        ``python`` (every body relayed on the loop); Config's ``relay`` and ``relay_slice_us``."""
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"the upstream must be an http:// or https:// URL, not {url.scheme}://")
        self.loop = asyncio.get_running_loop()
        self.host = url.host
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if url.scheme == "https" else None
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.relay_thread = relay == "thread" and THREAD_BUILT
        self.relay_slice_us = relay_slice_us
        self.fresh: list[UpstreamConn] = []  # idle, never carried an exchange: for any client
        self.kept: dict[asyncio.BaseTransport, list[UpstreamConn]] = {}  # idle, by the client they served
        self.active: set[UpstreamConn] = set()
        self.closed = False
        self.last_read = 0.0  # the latest read on the loop, any connection (perf_counter)
        self._turn_sink: TurnSink | None = None
        self._sweep: asyncio.TimerHandle | None = None

    @property
    def idle(self) -> list[UpstreamConn]:
        """Every idle connection, fresh or kept for a client (oldest first within each)."""
        return [*self.fresh, *(c for conns in self.kept.values() for c in conns)]

    @property
    def thread_turns(self) -> int:
        """Bodies handed to the relay thread on this loop so far."""
        return self._turn_sink.started if self._turn_sink is not None else 0

    def turn_sink(self) -> TurnSink:
        """This loop's mailbox for the relay thread (made on first use)."""
        if self._turn_sink is None:
            self._turn_sink = TurnSink(self.loop, self.relay_slice_us)
        return self._turn_sink

    def activity(self) -> float:
        """The latest read of any body, on the loop or by the relay thread (the measuring worker waits for a gap)."""
        return max(self.last_read, thread_last_read())

    async def request(self, method: str, data: bytes, owner: asyncio.BaseTransport | None = None) -> UpstreamConn:
        """Send one request (head and body in ``data``) for the client connection ``owner`` (its transport;
        None: a client that will not send another request); return the connection once its response head
        is in. Raises ``UpstreamError``."""
        conn = self._take_idle(owner)
        if conn is not None:
            try:
                return await self._send(conn, method, data, owner)
            except UpstreamError:
                if not (conn.unanswered and conn.exchanges > 1):
                    raise
                # A kept-alive connection the upstream closed as the request went out, before a byte of any
                # answer: the idle close raced our send (llama-server closes after each streamed response;
                # the peek at checkout cannot see a close still on its way). Once more, on a new connection.
        return await self._send(await self._connect(), method, data, owner)

    async def _send(self, conn: UpstreamConn, method: str, data: bytes, owner) -> UpstreamConn:
        self.active.add(conn)
        conn.owner = owner
        try:
            await conn.send(method, data)
        except BaseException:
            self.active.discard(conn)
            conn.abandon("client_abort", "no response")
            raise
        return conn

    def _take_idle(self, owner: asyncio.BaseTransport | None) -> UpstreamConn | None:
        """The newest idle connection kept for ``owner``, else a fresh one; never one another client's
        exchange went over. One that has bytes waiting (the loop has not read them yet) or has been closed
        by the upstream is dropped: whatever waits there is no answer to the request about to be sent."""
        mine = self.kept.pop(owner, None) if owner is not None else None
        try:
            for conns in (mine, self.fresh):
                while conns:
                    conn = conns.pop()
                    transport = conn.transport
                    if transport is not None and not transport.is_closing() and conn.state == _IDLE:
                        if not _pending(transport):
                            return conn
                    conn.close()
            return None
        finally:
            if mine:  # the owner's others stay kept for it
                self.kept[owner] = mine

    async def probe(self, timeout_s: float) -> UpstreamError | None:
        """Connect once: None when the upstream accepts a connection within ``timeout_s``, else why not, in
        the words a request's 502 or 504 would use. Nothing is sent. For start-up's check. The connection
        joins the fresh idle ones, for the first request to use: the check costs the upstream no connection."""
        try:
            conn = await self._connect(min(timeout_s, self.connect_timeout_s))
        except UpstreamError as exc:
            return exc
        if self.closed:
            conn.close()
            return None
        self._idle(conn)
        self.fresh.append(conn)
        return None

    async def _connect(self, timeout_s: float | None = None) -> UpstreamConn:
        timeout_s = self.connect_timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await self.loop.create_connection(
                    lambda: UpstreamConn(self), self.host, self.port, ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None,
                )
        except TimeoutError:
            within = f"connect_timeout_s ({timeout_s:g} s)" if timeout_s == self.connect_timeout_s else f"{timeout_s:g} s"
            raise UpstreamError(f"no connection within {within}", timeout=True) from None
        except (OSError, ssl.SSLError) as exc:
            # the system's words for the errno ("Connection refused"), the same on every event loop
            # (asyncio's own loop says "Connect call failed (...)" where uvloop says "Connection refused")
            errno = getattr(exc, "errno", None)
            detail = (os.strerror(errno) if isinstance(errno, int) and errno > 0 else None) or \
                getattr(exc, "strerror", None) or type(exc).__name__
            raise UpstreamError(f"cannot connect to the upstream: {detail}") from None
        return conn

    def _release(self, conn: UpstreamConn) -> None:
        """After an exchange that ended well: kept for the client connection it served, if that is still
        there; else closed."""
        self.active.discard(conn)
        owner = conn.owner
        if self.closed or conn.transport is None or owner is None or owner.is_closing():
            conn.close()
            return
        self._idle(conn)
        self.kept.setdefault(owner, []).append(conn)
        if self._sweep is None:
            self._sweep = self.loop.call_later(SWEEP_S, self._sweep_kept)

    def _idle(self, conn: UpstreamConn) -> None:
        conn.state = _IDLE
        conn.head = None
        conn._parked = []
        conn.framing = None
        conn._pool_timer = self.loop.call_later(POOL_IDLE_S, conn.close)

    def _sweep_kept(self) -> None:
        """Close the connections kept for clients that have gone; again in ``SWEEP_S`` while any are kept."""
        self._sweep = None
        for owner in [o for o in self.kept if o.is_closing()]:
            for conn in self.kept.pop(owner):
                conn.close()
        if self.kept and not self.closed:
            self._sweep = self.loop.call_later(SWEEP_S, self._sweep_kept)

    def _forget(self, conn: UpstreamConn) -> None:
        self.active.discard(conn)
        if conn in self.fresh:
            self.fresh.remove(conn)
        conns = self.kept.get(conn.owner) if conn.owner is not None else None
        if conns is not None and conn in conns:
            conns.remove(conn)
            if not conns:
                del self.kept[conn.owner]

    def close(self) -> None:
        self.closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in [*self.idle, *self.active]:
            conn.close()
        self.fresh.clear()
        self.kept.clear()
        if self._turn_sink is not None:
            self._turn_sink.close()
