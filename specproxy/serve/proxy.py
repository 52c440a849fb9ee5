"""The forwarding path: relays every request to the one configured upstream.

Why it looks like this: a measuring tool must not disturb what it measures. Two fronts read requests:
the lane (``lane.py``) takes the common, plainly well-formed request straight from the socket, and hands
any other, from its first byte, to aiohttp's low-level server, which parses and vets it (the checks
below); both call ``Proxy.forward`` with an ``Incoming`` and a ``Client``. The response is relayed by
``upstream.UpstreamConn``: per read of the upstream's body, inside the socket callback, it takes a
monotonic timestamp, writes the bytes to the client's transport (chunk framing passed verbatim), takes
another timestamp and appends to the turn's ``RecordBuilder``. The handler's task only waits: for the
end, or for a slow client to drain (backpressure). No parsing, tokenizing or database work happens on
the event loop; once the response has ended, the builder is handed to a worker thread that makes the
``Record``, and the record goes to a sink whose ``put`` never blocks.

Transparency rules: the upstream is the configured one, never one taken from the request (absolute-form
URIs, Host, X-Forwarded-Host, a body's ``base_url`` are ignored); request and response bodies pass
byte-identical, and so do header bytes (even obs-text); hop-by-hop headers (RFC 9110 section 7.6.1) are
dropped, end-to-end ones kept; nothing is decompressed or compressed; a POST is never retried.

Defences, each checked before anything is forwarded (so a refused request never reaches the upstream):
ambiguous framing (Transfer-Encoding other than a lone ``chunked``, with Content-Length, in HTTP/1.0;
repeated Content-Length), control characters in headers and HTTP versions other than 1.0/1.1 get 400;
headers over ``MAX_HEADER_BYTES`` in total get 431; a body over ``max_body_bytes`` gets 413 (at once when
its Content-Length says so); a body that stalls for ``header_timeout_s``, or is not whole within
``body_timeout_s``, gets 408; more than ``max_concurrent`` requests in flight (counted once their body
is whole, so that slow bodies hold no one's place) get 503. Header names with an underscore are not
forwarded either way (as nginx drops them by default): a server that reads ``_`` as ``-`` would take
``Transfer_Encoding`` for framing nobody vetted. aiohttp's parser rejects most malformed requests itself;
these checks cover what it lets through (its pure-Python parser is more lenient than its C one).

Nothing a client sent (headers, query, body) reaches the logs or a record's ``error``: errors are
described by their type and our own words, with any URL removed.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import aiohttp
import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from yarl import URL

from specproxy.config import Config
from specproxy.measure.builder import RecordBuilder, is_measured
from specproxy.serve.measuring import MeasuringWorker
from specproxy.record import Record, new_turn_id
from specproxy.measure.tokens import Tokenizer
from specproxy.wire.upstream import (
    CHUNKED,
    CLOSE,
    DECHUNK,
    ENCODE,
    PASS,
    ResponseHead,
    UpstreamError,
    UpstreamPool,
)

__all__ = ["LABEL_HEADER", "Proxy"]

log = logging.getLogger("specproxy.serve.proxy")

LABEL_HEADER = "X-Specproxy-Label"

# RFC 9110 7.6.1: meaningful only for one connection, never forwarded. Plus Host (set for the
# upstream) and Content-Length (recomputed from the exact body we send).
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Connection",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
    )
)
# Expect: the proxy has read the whole body before it forwards; passing "100-continue" on would make the
# upstream client wait for an interim response some servers never send.
_NOT_FORWARDED_UP = _HOP_BY_HOP | {"host", "content-length", "expect", LABEL_HEADER.lower()}
_NOT_FORWARDED_DOWN = _HOP_BY_HOP
_NOT_FORWARDED_UP_B = frozenset(h.encode() for h in _NOT_FORWARDED_UP)
_NOT_FORWARDED_DOWN_B = frozenset(h.encode() for h in _NOT_FORWARDED_DOWN)

MAX_PENDING_BUILDS = 10000  # turns waiting to be measured; past this a turn is forwarded but not measured
MAX_FIELD_BYTES = 16384  # one header line (aiohttp's parser answers 400 past it)
MAX_HEADER_BYTES = 65536  # all request headers together (431 past it; aiohttp only bounds each line and the count)
_BAD_HEADER_BYTES = re.compile(rb"[\x00\r\n]")

http_log = logging.getLogger("specproxy.http")


class _NoRequestContent(logging.Filter):
    """aiohttp logs a malformed request with its offending bytes, and a header line can hold an API key:
    keep the exception's type and where it was raised, drop its message and arguments."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            status = getattr(exc, "code", None) or getattr(exc, "status", None)
            record.msg = f"{record.getMessage()}: {type(exc).__name__}{f' {status}' if status else ''} ({_where(exc)})"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


http_log.addFilter(_NoRequestContent())

clock = time.perf_counter


class Refusal(NamedTuple):
    """An answer of our own instead of the upstream's (the request was refused, or the upstream gave no
    response): an OpenAI-style JSON error. Each front writes it its own way (``as_response``, ``lane``)."""

    status: int
    kind: str
    message: str
    close: bool = False

    def body(self) -> bytes:
        return orjson.dumps({"error": {"message": f"specproxy: {self.message}", "type": self.kind,
                                       "code": self.status}})

    def as_response(self) -> web.Response:
        resp = web.Response(status=self.status, body=self.body(), content_type="application/json")
        if self.close:
            resp.force_close()
        return resp


def _error_response(status: int, kind: str, message: str, *, close: bool = False) -> Refusal:
    return Refusal(status, kind, message, close)


def body_timeout(cfg: Config, whole: bool) -> Refusal:
    """408 for a request body that stalled (``header_timeout_s`` without a byte) or was not complete within
    ``body_timeout_s`` of its head (``whole``), whichever front read it."""
    why = (f"request body not complete within {cfg.body_timeout_s:g} s" if whole
           else f"request body stalled for {cfg.header_timeout_s:g} s")
    return _error_response(408, "request_timeout", why, close=True)


def _refuse(request: web.BaseRequest) -> Refusal | None:
    """Requests that must not be forwarded, decided from the request line and headers alone."""
    if request.method == "CONNECT":
        return _error_response(405, "method_not_allowed", "CONNECT is not supported: this is a reverse proxy",
                               close=True)
    version = request.version
    if version != aiohttp.HttpVersion11 and version != aiohttp.HttpVersion10:
        return _error_response(400, "bad_request", "only HTTP/1.0 and HTTP/1.1 are supported", close=True)
    headers = request.headers
    te = headers.getall("Transfer-Encoding", ())
    if te:
        # RFC 9112 6.1 and 6.3: chunked must be the only, final coding; TE with Content-Length or in
        # HTTP/1.0 is faulty framing. Both can smuggle a second request past a front end.
        if version == aiohttp.HttpVersion10 or len(te) != 1 or te[0].strip().lower() != "chunked":
            return _error_response(400, "bad_request", "ambiguous or unsupported Transfer-Encoding", close=True)
        if "Content-Length" in headers:
            return _error_response(400, "bad_request", "both Transfer-Encoding and Content-Length", close=True)
    if len(headers.getall("Content-Length", ())) > 1:
        return _error_response(400, "bad_request", "more than one Content-Length", close=True)
    raw = request.raw_headers
    fields = [part for pair in raw for part in pair]
    if _BAD_HEADER_BYTES.search(b"\x01".join(fields)):  # one search over all names and values
        return _error_response(400, "bad_request", "control character in a header", close=True)
    if sum(map(len, fields)) + 4 * len(raw) > MAX_HEADER_BYTES:
        return _error_response(431, "headers_too_large", f"request headers over {MAX_HEADER_BYTES} bytes",
                               close=True)
    return None


class Proxy:
    """Holds the upstream session, the in-flight counts and the measuring workers."""

    def __init__(
        self,
        cfg: Config,
        *,
        tokenizer: Tokenizer | None,
        sink: Callable[[Record], Any],
        instance_id: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.cfg = cfg
        self.upstream = cfg.upstream_url
        # requests go to the upstream's path prefix (if any; a trailing /v1 is not one: config.server_root)
        # + the client's path and query, as sent
        self._base_path = self.upstream.raw_path.rstrip("/").encode()
        self._host_header = _host_header(self.upstream)
        self.tokenizer = tokenizer
        self.sink = sink
        self.instance_id = instance_id
        self.in_flight = 0  # every request being handled
        self.measured_in_flight = 0  # measured turns in flight: the operating point the upstream sees
        self.turns_started = 0
        self.last_turn_done = 0.0  # monotonic time the latest measured turn ended
        self.on_turn_end: Callable[[str, float, float, bool], object] | None = None
        self.measure_dropped = 0
        self.measure_errors = 0
        self.rejected_busy = 0
        self.rejected_bad = 0  # malformed, ambiguous, too large or too slow requests, never forwarded
        self._pending_builds = 0
        self._pool: UpstreamPool | None = None
        self._measurer: MeasuringWorker | None = None
        self._idle = asyncio.Event()

    # --- lifecycle --------------------------------------------------------------------------------

    def make_server(self) -> web.Server:
        """aiohttp's low-level server: every request to ``handle``. A proxy routes nothing, so there is no
        Application, router or middleware chain to pay for on each request."""
        return web.Server(
            self.handle,
            handler_cancellation=True,  # a client that hangs up cancels its handler: the turn is kept
            access_log=None,
            max_field_size=MAX_FIELD_BYTES,
            auto_decompress=False,  # a gzip request body is forwarded as it came, with its Content-Encoding
            # aiohttp closes a connection that has not sent a complete request within this long of the
            # previous response (and, in recent versions, of connecting; service.py also enforces that)
            keepalive_timeout=self.cfg.header_timeout_s,
            logger=http_log,
        )

    async def start(self) -> None:
        """Before the first request: the upstream pool and the measuring worker (they need the loop)."""
        pool = self._pool = UpstreamPool(self.upstream, connect_timeout_s=self.cfg.connect_timeout_s,
                                         idle_timeout_s=self.cfg.idle_timeout_s)
        self._measurer = MeasuringWorker(self.tokenizer, pool.activity, asyncio.get_running_loop(),
                                         self._built)

    async def close(self) -> None:
        """After the last request: close the pool, measure what is pending, stop the worker. Idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
        await self.drain_measurements()
        measurer, self._measurer = self._measurer, None
        if measurer is not None:
            await asyncio.to_thread(measurer.stop)  # joining a thread blocks: not on the loop

    async def probe_upstream(self, timeout_s: float) -> UpstreamError | None:
        """Whether the upstream accepts a connection now (None) or why not (``UpstreamPool.probe``)."""
        assert self._pool is not None
        return await self._pool.probe(timeout_s)

    async def drain_measurements(self, timeout: float = 30.0) -> None:
        """Wait until every finished turn has been measured and handed to the sink."""
        deadline = time.monotonic() + timeout
        while self._pending_builds and time.monotonic() < deadline:
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), max(deadline - time.monotonic(), 0.01))
            except TimeoutError:
                break

    # --- the handler ------------------------------------------------------------------------------

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """aiohttp's server: every request the lane (``lane.py``) did not take."""
        refused = _refuse(request)  # before anything else, e.g. CONNECT's authority-form target
        if refused is not None:
            self.rejected_bad += 1
            return refused.as_response()
        body = await self._read_body(request)  # not counted in flight yet: a slow body holds no one's place
        if not isinstance(body, bytes):
            self.rejected_bad += 1
            resp = body.as_response()
            if body.status == 408:  # the client stalled: answer and hang up now, not after lingering on
                await resp.prepare(request)
                await resp.write_eof()
                if request.transport is not None:
                    request.transport.close()
            return resp  # nothing was sent upstream
        if self.in_flight >= self.cfg.max_concurrent:
            self.rejected_busy += 1
            return self.busy().as_response()
        self.in_flight += 1
        try:
            client = _AiohttpClient(request)
            refusal = await self.forward(_incoming(request), body, client)
            return refusal.as_response() if refusal is not None else client.response
        finally:
            self.in_flight -= 1

    def busy(self) -> Refusal:
        return _error_response(503, "busy", f"more than {self.cfg.max_concurrent} requests in flight")

    async def _read_body(self, request: web.BaseRequest) -> bytes | Refusal:
        """The whole body, or the refusal: 413 over ``max_body_bytes``, 408 when it stalls."""
        limit = self.cfg.max_body_bytes
        declared = request.content_length
        if declared is not None and declared > limit:
            return _error_response(413, "body_too_large", f"request body over {limit} bytes", close=True)
        expect = request.headers.get("Expect")
        if expect is not None and request.version == aiohttp.HttpVersion11:
            if expect.lower() != "100-continue":
                return _error_response(417, "expectation_failed", "only Expect: 100-continue is understood",
                                       close=True)
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # the client may send the body now
            request.writer.output_size = 0  # an interim response is not part of the answer's size
        content = request.content
        if content.is_eof():  # the whole body came with the head (the usual case): no wait, no deadline
            try:
                data = content.read_nowait(-1)
            except (RequestPayloadError, HttpProcessingError):
                return _error_response(400, "bad_request", "malformed request body", close=True)
            if len(data) > limit:
                return _error_response(413, "body_too_large", f"request body over {limit} bytes", close=True)
            return data
        parts: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        whole_by = loop.time() + self.cfg.body_timeout_s
        while True:
            stall_by = loop.time() + self.cfg.header_timeout_s
            try:
                async with asyncio.timeout_at(min(stall_by, whole_by)):
                    data = await content.readany()
            except TimeoutError:
                return body_timeout(self.cfg, whole_by <= stall_by)
            except (RequestPayloadError, HttpProcessingError):
                return _error_response(400, "bad_request", "malformed request body", close=True)
            if not data:
                return b"".join(parts)
            size += len(data)
            if size > limit:
                return _error_response(413, "body_too_large", f"request body over {limit} bytes", close=True)
            parts.append(data)

    async def forward(self, req: Incoming, body: bytes, client: Client) -> Refusal | None:
        """One exchange with the upstream, from either front, the request read whole and vetted: relayed to
        ``client`` (None), or a refusal when the upstream gave no response. Measured turns get a builder,
        handed to the measuring worker at the end whatever happened."""
        t_request = clock()
        builder = None
        if is_measured(req.method, req.path):
            self.measured_in_flight += 1
            self.turns_started += 1
            started_before = self.turns_started
            prev_done = self.last_turn_done
            builder = RecordBuilder(
                method=req.method,
                path=req.path,
                body=body,
                t_wall=time.time(),
                t_request=t_request,
                concurrency=self.measured_in_flight,
                label=req.label or self.cfg.label,
                instance_id=self.instance_id(),
                store_text=self.cfg.store_text,
                request_encoding=req.content_encoding,
                max_bytes=self.cfg.max_measured_bytes,
            )
        try:
            return await self._relay(req, body, builder, client)
        except Exception as exc:  # a bug of ours, not the client's nor the upstream's: still one record
            if builder is not None and not builder._ended:
                reason = f"{type(exc).__name__} ({_where(exc)})"  # its message might quote the request
                if builder.t_upstream_headers is None:
                    builder.fail(clock(), "proxy_error", None, reason)
                else:
                    builder.finish(clock(), "proxy_error", reason)
            raise
        finally:
            if builder is not None:
                self.measured_in_flight -= 1
                self._submit(builder)
                # a turn that ran alone can be joined with the server's counter deltas over it
                alone = builder.concurrency == 1 and self.turns_started == started_before
                self.last_turn_done = clock()
                if self.on_turn_end is not None:
                    self.on_turn_end(builder.id, t_request, prev_done, alone)

    async def _relay(self, req: Incoming, body: bytes, b: RecordBuilder | None, client: Client) -> Refusal | None:
        assert self._pool is not None
        try:
            head_bytes = _request_head(self._base_path, self._host_header, req, body)
            conn = await self._pool.request(req.method, head_bytes + body)
            exchange = conn.exchanges  # abandon only this exchange, never a later one on a reused connection
        except UpstreamError as exc:
            # refused, reset or malformed: 502; no connection within connect_timeout_s, or no response
            # head within idle_timeout_s: 504. Either way the upstream gave no response to relay.
            status = 504 if exc.timeout else 502
            if b is not None:
                b.fail(clock(), "upstream_unreachable", status, str(exc))
            kind = "upstream_timeout" if status == 504 else "upstream_unreachable"
            return _error_response(status, kind, f"no response from the upstream: {exc}")
        try:
            head = conn.head
            assert head is not None
            if b is not None:
                b.on_headers(conn.t_head, head.status, _latin(head.get(b"content-type")),
                             _latin(head.get(b"content-encoding")), chunked=head.framing == CHUNKED)
            raw, mode, keep = _response_head(head, req)
            await client.start(head.status, raw, keep)
            transport = client.transport
            if transport is None:  # the client left while we waited for the upstream
                conn.abandon("client_abort", "client disconnected", exchange)
                return None
            conn.attach(transport, b, mode)
            while conn.outcome is None:
                await conn.wait()
                if conn.paused:  # the client reads slower than the upstream sends: wait for it to drain
                    await client.drain()
                    conn.resume()
            return None
        except asyncio.CancelledError:  # the client hung up (its front cancels the handler): keep the turn
            conn.abandon("client_abort", "client disconnected", exchange)
            raise
        except Exception as exc:  # a bug of ours: the turn is recorded as such, the client sees a cut
            conn.abandon("proxy_error", f"{type(exc).__name__} ({_where(exc)})", exchange)
            client.abort()
            raise

    # --- measuring, off the forwarding path -----------------------------------------------------------

    def _submit(self, builder: RecordBuilder) -> None:
        if not builder._ended:  # e.g. cancelled while reading: still one record per turn
            builder.fail(clock(), "client_abort", None, "client disconnected before the response")
        if self._pending_builds >= MAX_PENDING_BUILDS:
            self.measure_dropped += 1
            return
        self._pending_builds += 1
        assert self._measurer is not None
        self._measurer.submit(builder, more_in_flight=self.measured_in_flight > 0)

    def _built(self, results: list[tuple[RecordBuilder, Record | None, BaseException | None]]) -> None:
        """On the loop, once per batch the measuring worker built."""
        self._pending_builds -= len(results)
        if not self._pending_builds:
            self._idle.set()
        for builder, record, exc in results:
            if exc is not None or record is None:
                # measuring failed (a bug, e.g. on input nobody foresaw): the turn still gets its row
                self.measure_errors += 1
                why = f"{type(exc).__name__} ({_where(exc)})" if exc is not None else "no record"
                log.error("measuring a turn failed: %s", why)
                self.sink(_unmeasured(builder, f"measuring failed: {why}"))
            else:
                self.sink(record)


class Incoming(NamedTuple):
    """What the forwarding path needs of a client's request, whichever front read it (aiohttp's server or
    the lane): the request line, the header bytes as they came, and the few header values it acts on."""

    method: str
    path: str  # the decoded path, without the query: which endpoint (``is_measured``)
    target: bytes  # the path and query as sent, forwarded as they are
    http11: bool
    keep_alive: bool  # the client allows another request on the connection after this one
    raw_headers: Sequence[tuple[bytes, bytes]]
    connection: Sequence[str | bytes]  # the Connection header's values: more hop-by-hop names
    label: str | None  # X-Specproxy-Label
    content_encoding: str  # of the request body


class Client(Protocol):
    """The front's side of one exchange: where the response goes."""

    @property
    def transport(self) -> asyncio.Transport | None: ...

    async def start(self, status: int, head: bytes, keep_alive: bool) -> None:
        """Write the response head (the body follows on ``transport``)."""

    async def drain(self) -> None:
        """Until the client has taken what waits in the transport's buffer."""

    def abort(self) -> None:
        """Cut the connection (a bug of ours mid-response)."""


def _incoming(request: web.BaseRequest) -> Incoming:
    headers = request.headers
    return Incoming(
        method=request.method,
        path=request.rel_url.path,
        target=request.rel_url.raw_path_qs.encode(),
        http11=request.version == aiohttp.HttpVersion11,
        keep_alive=request.keep_alive,
        raw_headers=request.raw_headers,
        connection=headers.getall("Connection", ()),
        label=headers.get(LABEL_HEADER),
        content_encoding=headers.get("Content-Encoding", ""),
    )


class _AiohttpClient:
    """``Client`` for a request aiohttp's server read: the head goes out through a ``_RelayedResponse``,
    which keeps aiohttp's bookkeeping right; ``response`` is what the handler returns."""

    __slots__ = ("request", "response")

    def __init__(self, request: web.BaseRequest) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.request.transport  # type: ignore[return-value]

    async def start(self, status: int, head: bytes, keep_alive: bool) -> None:
        self.response = _RelayedResponse(status, head, keep_alive)
        await self.response.prepare(self.request)

    async def drain(self) -> None:
        await self.request.writer.drain()

    def abort(self) -> None:
        _abort(self.request)


def _request_head(self_base_path: bytes, host: bytes, req: Incoming, body: bytes) -> bytes:
    """The request line and headers for the upstream: the client's header bytes as they came, minus
    hop-by-hop ones and our own; Host is the upstream's; Content-Length is that of the exact body sent."""
    named = _connection_named(req.connection)
    out = [b"%s %s%s HTTP/1.1\r\nHost: %s\r\n" % (req.method.encode(), self_base_path, req.target, host)]
    for name, value in req.raw_headers:
        low = name.lower()
        if low not in _NOT_FORWARDED_UP_B and low not in named and b"_" not in low:
            out.append(b"%s: %s\r\n" % (name, value))
    if body or req.method not in ("GET", "HEAD"):
        out.append(b"Content-Length: %d\r\n" % len(body))
    out.append(b"\r\n")
    return b"".join(out)


def _host_header(url: URL) -> bytes:
    host = url.raw_host or ""
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    if url.explicit_port and url.port != {"http": 80, "https": 443}.get(url.scheme):
        host = f"{host}:{url.port}"
    return host.encode("ascii")


def _connection_named(values) -> set[bytes]:
    """Header names a Connection header lists (RFC 9110 7.6.1): hop-by-hop for this one connection."""
    named: set[bytes] = set()
    for value in values:
        if isinstance(value, str):
            value = value.encode("latin-1", "replace")
        named.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return named


def _response_head(head: ResponseHead, req: Incoming) -> tuple[bytes, int, bool]:
    """The client's response head, how its body is framed for the client, and whether the connection is kept.

    The upstream's header bytes pass unchanged, minus hop-by-hop ones. A chunked body passes with its
    framing to an HTTP/1.1 client, and is unframed for an HTTP/1.0 one (which then sees the end by the
    close); a body that ends by the upstream's close is chunked for an HTTP/1.1 client."""
    http11 = req.http11
    keep = http11 and req.keep_alive
    named = _connection_named([v for k, v in head.headers if k.lower() == b"connection"])
    framing = head.framing
    lines = [b"HTTP/1.%d %d %s\r\n" % (1 if http11 else 0, head.status, head.reason)]
    for name, value in head.headers:
        low = name.lower()
        if low in _NOT_FORWARDED_DOWN_B or low in named or b"_" in low:
            continue
        if low == b"content-length" and head.transfer_encoding:
            continue  # RFC 9112 6.3: Transfer-Encoding overrides it, whatever framing follows; both invite smuggling
        lines.append(b"%s: %s\r\n" % (name, value))
    mode = PASS
    if framing == CHUNKED:
        if http11:
            lines.append(b"Transfer-Encoding: chunked\r\n")
        else:
            mode, keep = DECHUNK, False
    elif framing == CLOSE:
        if http11:
            mode = ENCODE
            lines.append(b"Transfer-Encoding: chunked\r\n")
        else:
            keep = False
    if not keep and http11:
        lines.append(b"Connection: close\r\n")
    lines.append(b"\r\n")
    return b"".join(lines), mode, keep


class _RelayedResponse(web.StreamResponse):
    """aiohttp's bookkeeping for a response (keep-alive, "already sent") whose head and body the relay
    writes to the transport itself, so that the upstream's header bytes and chunk framing pass verbatim."""

    def __init__(self, status: int, head: bytes, keep_alive: bool) -> None:
        super().__init__(status=status)
        self._head_bytes = head
        self._keep_alive = keep_alive  # aiohttp decides from this whether to read another request

    async def _start(self, request: web.BaseRequest):  # type: ignore[override]
        self._req = request
        writer = self._payload_writer = request._payload_writer
        transport = request.transport
        if transport is not None:
            transport.write(self._head_bytes)
        writer.output_size += len(self._head_bytes)  # so aiohttp never appends an error page to it
        return writer


def _latin(value: bytes | None) -> str:
    return value.decode("latin-1") if value is not None else ""


def _abort(request: web.BaseRequest) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()


def _where(exc: BaseException) -> str:
    """Where an exception was raised (file:line), for logs and records that must not quote its message."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f"raised at {frames[-1].filename}:{frames[-1].lineno}" if frames else "raised at ?"


def _unmeasured(b: RecordBuilder, error: str) -> Record:
    """The row of a turn whose measuring failed: what the forwarding path knew, nothing derived."""
    return Record(
        id=getattr(b, "id", None) or new_turn_id(),
        t_wall=b.t_wall,
        method=b.method,
        path=b.path,
        status=b.status,
        outcome="proxy_error",
        error=f"{error}; forwarding outcome {b.outcome}"[:300],
        label=b.label,
        instance_id=b.instance_id,
        concurrency=b.concurrency,
        t_request=b.t_request,
        t_upstream_headers=b.t_upstream_headers,
        t_done=b.t_done,
        total_s=b.t_done - b.t_request if b.t_done is not None else None,
        request_bytes=len(b.body),
        response_bytes=sum(map(len, b.reads)),
        measure_capped=b.capped,
    )
