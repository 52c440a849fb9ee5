"""The lane: the common request, read from the client's socket and forwarded without aiohttp's server.

Why: most of what the event loop spends on a streamed turn is per request, not per chunk (the relay thread
carries the body), and at a server's real pace (a few new turns per decode step) each request finds the
loop's caches cold. aiohttp's server handles a request in several layers (its protocol, a task, the
request and writer objects, a URL, a header dict, the response's bookkeeping), each costing the loop
CPU per request that a bare protocol does not (docs/performance.md, "Design figures").

What it takes: a request that is plainly well-formed and whole. HTTP/1.1; a method from a short list; an
origin-form target of letters, digits and ``-._~!$&'()*+,;=:@/?`` (no ``%``, no dot segments, no
``//``); header lines of token names and values without control characters (a tab aside); none of
Transfer-Encoding, Expect, Upgrade; one Host; no single-valued header twice (aiohttp's list and RFC
9110's); Content-Length, if any, of digits, within ``max_body_bytes``; the head under aiohttp's
limits. It waits for the body (it is usually in the same read) and forwards the request with
``Proxy.exchange``, as aiohttp's handler does.

Anything else it declines: from that request on, the connection is aiohttp's, which reads the request
from its first byte (the lane has consumed nothing of it) and vets, refuses or forwards it as it always
did. So every defence of ``proxy.py`` still applies; the lane refuses nothing itself but a body that
stalls or is not whole within ``body_timeout_s`` (408, as aiohttp's path answers it) and a request over
``max_concurrent`` once its body is whole (503, the same check).
Config ``lane = false`` sends every connection to aiohttp (comparisons, and a way around a lane bug).

A connection's requests are served one at a time, in order (pipelined ones wait in the buffer, charged to
the memory budget; a connection stops reading when more than ``PIPELINED_BYTES`` waits on it, or
``PIPELINED_SHARE`` of the budget on all of them). A client that hangs up cancels its exchange, which ``Proxy.forward``
records as ``client_abort``. An idle connection closes ``header_timeout_s`` after its last response
(aiohttp's keep-alive timeout, set to the same); the first request's head deadline is ``service.py``'s.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import http_parser as _aiohttp_parser

from specproxy.serve.admin import PREFIX, reserved
from specproxy.serve.headers import LABEL_HEADER, connection_tokens
from specproxy.serve.incoming import Incoming
from specproxy.serve.proxy import SMALL_BODY
from specproxy.serve.refusals import MAX_HEADER_BYTES, Refusal, body_timeout
from specproxy.wire import memory
from specproxy.wire.sockets import no_delay

if TYPE_CHECKING:
    from specproxy.serve.proxy import Proxy

__all__ = ["Lane", "Lanes", "read_head"]

log = logging.getLogger("specproxy.serve.lane")

MAX_LINE_BYTES = 8190  # aiohttp's request-line limit; every line the lane takes is within it
MAX_FIELDS = 100  # aiohttp refuses more than 128 header lines
PIPELINED_BYTES = 1 << 20  # stop reading while this much waits behind the exchange in progress
PIPELINED_SHARE = 0.125  # of the memory budget: what all connections' pipelined bytes may hold (and a read each)
LINGER_S = 10.0  # after refusing a body unread, read and drop what the client still sends for this long

_METHODS = frozenset((b"GET", b"POST", b"PUT", b"PATCH", b"DELETE", b"OPTIONS", b"HEAD"))
_REQUEST_LINE = re.compile(rb"([A-Z]{3,7}) (/[A-Za-z0-9\-._~!$&'()*+,;=:@/?]*) HTTP/1\.1\r\n")
_FIELD_LINES = re.compile(rb"(?:[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*\r\n)*")
_DECLINED = frozenset((b"transfer-encoding", b"expect", b"upgrade"))
# header fields a request may have once (RFC 9110); aiohttp's parser refuses a second one of those it lists
_SINGLETONS = frozenset(
    {b"content-length", b"content-location", b"content-range", b"content-type", b"etag", b"host",
     b"max-forwards", b"server", b"transfer-encoding", b"user-agent"}
    | {h.encode() for h in getattr(_aiohttp_parser, "SINGLETON_HEADERS", ())}
)
_LABEL = LABEL_HEADER.lower().encode()
_RESERVED = PREFIX.encode()


def read_head(buf: bytes, end: int, max_body: int) -> tuple[Incoming, int, int] | None:
    """The request whose head is ``buf[:end]`` (``end``: where its blank line starts), and where its body
    starts and ends in ``buf``; None when the lane declines it (see the module's docstring)."""
    if end + 4 > MAX_HEADER_BYTES:
        return None
    m = _REQUEST_LINE.match(buf)
    if m is None or m.end() > end + 2 or m.end() > MAX_LINE_BYTES:
        return None
    method, target = m.groups()
    if (method not in _METHODS or b"//" in target or b"/." in target or target.startswith(_RESERVED)
            or (b"%" in target and reserved(target.partition(b"?")[0].decode("latin-1")))):
        return None  # (the reserved prefix: specproxy's own pages, answered behind aiohttp's server)
    start = m.end()
    raw: list[tuple[bytes, bytes]] = []
    length = 0
    connection: list[bytes] = []
    label = None
    encoding = ""
    seen_encoding = False
    once: set[bytes] = set()
    if start < end:
        if _FIELD_LINES.fullmatch(buf, start, end + 2) is None:
            return None
        lines = buf[start:end].split(b"\r\n")
        if len(lines) > MAX_FIELDS:
            return None
        for line in lines:
            if len(line) > MAX_LINE_BYTES:
                return None
            name, _, value = line.partition(b":")
            value = value.strip(b" \t")
            raw.append((name, value))
            low = name.lower()
            if low in _SINGLETONS:
                if low in once:
                    return None
                once.add(low)
            if low == b"content-length":
                if not value.isdigit() or len(value) > 15:
                    return None
                length = int(value)
            elif low == b"connection":
                connection.append(value)
            elif low == _LABEL:  # the first one, as aiohttp's headers.get(), decoded as it decodes values
                if label is None:
                    label = value.decode("utf-8", "surrogateescape")
            elif low == b"content-encoding":
                if not seen_encoding:
                    seen_encoding = True
                    encoding = value.decode("utf-8", "surrogateescape")
            elif low in _DECLINED:
                return None
    if length > max_body or b"host" not in once:  # HTTP/1.1 requires Host (aiohttp refuses a request without)
        return None
    keep_alive = b"close" not in connection_tokens(connection)
    req = Incoming(
        method=method.decode(),
        path=target.partition(b"?")[0].decode(),
        target=target,
        http11=True,
        keep_alive=keep_alive,
        raw_headers=raw,
        connection=connection,
        label=label,
        content_encoding=encoding,
    )
    return req, end + 4, end + 4 + length


def _may_become_head(buf: bytes) -> bool:
    """Whether the start of a head may still become one the lane takes: a line ends in a bare LF, or a
    complete request line is not one the lane reads, and the lane declines at once (aiohttp answers)."""
    nl = buf.find(b"\n")
    if nl < 0:
        return len(buf) <= MAX_LINE_BYTES
    if buf.count(b"\n") != buf.count(b"\r\n"):
        return False
    return _REQUEST_LINE.match(buf) is not None


class Lanes:
    """The lane's open connections and counts, for the service's state line and its shutdown."""

    def __init__(self) -> None:
        self.open: set[Lane] = set()
        self.requests = 0  # requests the lane forwarded
        self.handed_over = 0  # connections the lane gave to aiohttp's server
        self.piped = 0  # bytes read behind exchanges in progress (pipelined), charged to the memory budget
        self.closing = False

    def close_idle(self) -> None:
        """At shutdown: close idle connections now, busy ones after their exchange."""
        self.closing = True
        for lane in list(self.open):
            if lane._task is None:
                lane.close()

    def cut(self) -> None:
        """At shutdown, once the service stops waiting: cut the connections still busy (the idle ones are
        closing, their last bytes flushed)."""
        for lane in list(self.open):
            if lane._task is not None:
                lane.abort()


class Lane(asyncio.Protocol):
    """One client connection, until it is handed over to aiohttp's server (``inner``), if ever.

    It is also the ``proxy.Client`` of its exchanges: the response head goes straight to the transport."""

    __slots__ = ("_big", "_body_by", "_charged", "_deadline", "_drain", "_fallback", "_inner", "_keep", "_lanes", "_loop", "_parts", "_pending",
                 "_piped", "_proxy", "_reading_paused", "_size", "_task", "_timeout", "_timer", "_writing_paused",
                 "transport")

    def __init__(self, proxy: Proxy, lanes: Lanes, fallback: Callable[[], asyncio.Protocol], timeout: float) -> None:
        self._proxy = proxy
        self._lanes = lanes
        self._fallback = fallback
        self._timeout = timeout
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._inner: asyncio.Protocol | None = None
        self._parts: list[bytes] = []  # what has come and not been taken, in order
        self._size = 0
        self._pending: tuple[Incoming, int, int] | None = None  # a head read, its body still coming
        self._charged = 0  # the pending body's charge to the memory budget, until its exchange takes it
        self._piped = 0  # bytes that came during an exchange, charged to the budget until it ends
        self._big: bytearray | None = None  # a large pending body, grown in place as it comes (no join)
        self._task: asyncio.Task | None = None  # the exchange in progress
        self._keep = False
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        self._body_by = 0.0  # the pending body must be whole by then (body_timeout_s after its head)
        self._reading_paused = False
        self._writing_paused = False
        self._drain: asyncio.Future | None = None

    # --- asyncio callbacks ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._lanes.open.add(self)
        no_delay(transport)

    def data_received(self, data: bytes) -> None:
        inner = self._inner
        if inner is not None:
            inner.data_received(data)
            return
        big = self._big
        if big is not None:
            big += data
        else:
            self._parts.append(data)
        self._size += len(data)
        if self._task is None:
            self._take()
            return
        # pipelined behind the exchange in progress: charged to the memory budget (read already, so even
        # past it); past PIPELINED_BYTES on this connection, or PIPELINED_SHARE of the budget on all of
        # them, this connection reads no more until its exchange ends: many connections cannot hold more
        # than that share and one read each
        n = len(data)
        memory.charge(n)
        self._piped += n
        lanes = self._lanes
        lanes.piped += n
        if ((self._size > PIPELINED_BYTES or lanes.piped > self._proxy.budget * PIPELINED_SHARE)
                and not self._reading_paused and self.transport is not None):
            self._reading_paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        if self._inner is not None:
            return self._inner.eof_received()
        return None  # as aiohttp's server: the connection closes (and an exchange in progress ends)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._lanes.open.discard(self)
        self._cancel_timer()
        if self._inner is not None:
            self._inner.connection_lost(exc)
            return
        if self._task is not None:
            self._task.cancel()  # Proxy.forward records the turn as the client's abort
        self._release()
        self._wake_drain()

    def pause_writing(self) -> None:
        self._writing_paused = True
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._inner is not None:
            self._inner.resume_writing()
        self._wake_drain()

    # --- requests -------------------------------------------------------------------------------------

    def _joined(self) -> bytes:
        parts = self._parts
        if len(parts) > 1:
            parts[:] = [b"".join(parts)]
        return parts[0] if parts else b""

    def _take(self) -> None:
        """Start the next exchange if its request is all here; hand the connection over if it is not one
        the lane takes. Called with no exchange in progress."""
        pending = self._pending
        if pending is None:
            buf = self._joined()
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if self._size > MAX_HEADER_BYTES or not _may_become_head(buf):
                    self._hand_over()
                return
            pending = read_head(buf, end, self._proxy.cfg.max_body_bytes)
            if pending is None:
                self._hand_over()
                return
            size = pending[2] - pending[1]
            if size and not self._proxy.admit_body(size):  # the memory budget: refused before it is read
                self._refuse_unread(size)
                return
            self._charged = size
            # keep only what follows the head: the body then becomes one bytes object without a copy more
            req, start, need = pending
            rest = buf[start:]
            self._parts = [rest] if rest else []
            self._size = len(rest)
            pending = self._pending = (req, 0, need - start)
            if size > SMALL_BODY and self._size < size:  # grown in place: joining its reads would double it
                self._big = bytearray(rest)
                self._parts = []
            self._body_by = self._loop.time() + self._proxy.cfg.body_timeout_s
        req, start, need = pending
        if self._size < need:  # the body is still coming: it must not stall for longer than the timeout
            self._set_deadline()
            return
        big, self._big = self._big, None
        if big is not None:  # start is 0: the body is the bytearray itself (it is never written to again)
            rest = bytes(big[need:])
            del big[need:]
            body = big
        else:
            buf = self._joined()
            body = buf[start:need]
            rest = buf[need:]
        self._parts = [rest] if rest else []
        self._size = len(rest)
        self._pending = None
        self._lanes.requests += 1
        self._task = self._loop.create_task(self._serve(req, body))

    async def _serve(self, req: Incoming, body: bytes) -> None:
        self._charged = 0  # the exchange's from here (a task cancelled before it ran leaves it to _release)
        proxy = self._proxy
        self._keep = req.keep_alive
        try:
            refusal = await proxy.exchange(req, body, self)
            if refusal is not None:
                self._refuse(refusal, req.keep_alive)
        except asyncio.CancelledError:
            return  # the client hung up: the connection is gone
        except Exception as exc:  # a bug of ours (forward recorded the turn): this connection is done
            log.error("the lane's exchange failed: %s", type(exc).__name__)
            self.abort()
            return
        finally:
            self._task = None
        self._next()

    def _next(self) -> None:
        """After an exchange: close, or wait for the next request (it may be here already)."""
        self._release_piped()  # what came meanwhile is the next request's: its body is charged as such
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not self._keep or self._lanes.closing:
            transport.close()
            return
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        self._set_deadline()
        if self._size:
            self._take()

    def _refuse(self, refusal: Refusal, keep_alive: bool) -> None:
        keep = keep_alive and not refusal.close
        self._keep = self._keep and keep
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(refusal.as_bytes(keep))

    def _release(self) -> None:
        charged, self._charged = self._charged, 0
        if charged:
            self._proxy.release_body(charged)
        self._release_piped()

    def _release_piped(self) -> None:
        piped, self._piped = self._piped, 0
        if piped:
            self._lanes.piped -= piped
            memory.give(piped)

    def _refuse_unread(self, size: int) -> None:
        """503 for a body the memory budget has no room for, before a byte more of it is read; what the
        client still sends is read and dropped until it closes, for at most ``LINGER_S`` (closing at once
        could reset the connection before the client reads the answer)."""
        transport = self.transport
        self._parts = []
        self._size = 0
        self._pending = None
        self._lanes.open.discard(self)
        self._cancel_timer()
        if transport is None:
            return
        self._inner = _Drop(transport, self._loop)
        transport.write(self._proxy.memory_full(size).as_bytes(False))

    def _hand_over(self) -> None:
        """From this request on, the connection is aiohttp's: it gets every byte not taken yet."""
        self._lanes.handed_over += 1
        self._lanes.open.discard(self)
        self._cancel_timer()
        inner = self._inner = self._fallback()
        inner.connection_made(self.transport)
        if self._writing_paused:
            inner.pause_writing()
        data = self._joined()
        self._parts = []
        self._size = 0
        if data:
            inner.data_received(data)

    # --- proxy.Client -----------------------------------------------------------------------------------

    async def start(self, status: int, head: bytes, keep_alive: bool) -> None:
        self._keep = keep_alive
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(head)

    async def drain(self) -> None:
        if not self._writing_paused or self.transport is None:
            return
        self._drain = self._loop.create_future()
        try:
            await self._drain
        finally:
            self._drain = None

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _wake_drain(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # --- the deadline: one timer, re-armed only when it fires early -------------------------------------

    def _set_deadline(self) -> None:
        """The next read is due within the timeout; a pending body is due whole by ``_body_by`` besides."""
        self._deadline = self._loop.time() + self._timeout
        if self._pending is not None and self._body_by < self._deadline:
            self._deadline = self._body_by
        if self._timer is None:
            self._timer = self._loop.call_at(self._deadline, self._on_deadline)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_deadline(self) -> None:
        self._timer = None
        transport = self.transport
        if transport is None or self._inner is not None or self._task is not None:
            return  # an exchange in progress has no deadline of ours
        left = self._deadline - self._loop.time()
        if left > 0:
            self._timer = self._loop.call_at(self._deadline, self._on_deadline)
            return
        if self._pending is not None:  # a head read, its body stalled or too slow to be whole in time
            self._release()
            self._proxy.counters.rejected("bad")
            refusal = body_timeout(self._proxy.cfg, self._loop.time() >= self._body_by)
            transport.write(refusal.as_bytes(False))
        transport.close()  # idle for the keep-alive timeout, or a body that stalled


class _Drop(asyncio.Protocol):
    """A connection whose request body was refused unread: what comes is dropped; closed at the client's
    EOF or after ``LINGER_S``."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = loop.call_later(LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool | None:
        return None  # closes

    def connection_lost(self, exc: Exception | None) -> None:
        self._timer.cancel()
