"""The forwarding path: an aiohttp handler that relays every request to the one configured upstream.

Why it looks like this: a measuring tool must not disturb what it measures. Per read of the upstream's
body the handler does exactly: take a monotonic timestamp, write the bytes to the client, take another
timestamp, append to the turn's ``RecordBuilder``. No parsing, tokenizing or database work happens on
the event loop; once the response has ended, the builder is handed to a worker thread that makes the
``Record``, and the record goes to a sink whose ``put`` never blocks.

Transparency rules: the upstream is the configured one, never one taken from the request (absolute-form
URIs, Host, X-Forwarded-Host, a body's ``base_url`` are ignored); request and response bodies pass
byte-identical; hop-by-hop headers (RFC 9110 section 7.6.1) are dropped, end-to-end ones kept; the
upstream client never decompresses and the server never compresses; a POST is never retried.

Defences, each checked before anything is forwarded (so a refused request never reaches the upstream):
ambiguous framing (Transfer-Encoding other than a lone ``chunked``, with Content-Length, in HTTP/1.0;
repeated Content-Length), control characters in headers and HTTP versions other than 1.0/1.1 get 400;
headers over ``MAX_HEADER_BYTES`` in total get 431; a body over ``max_body_bytes`` gets 413 (at once when
its Content-Length says so); a body that stalls for ``header_timeout_s`` gets 408; more than
``max_concurrent`` requests in flight get 503. aiohttp's parser rejects most malformed requests itself;
these checks cover what it lets through (its pure-Python parser is more lenient than its C one).

Nothing a client sent (headers, query, body) reaches the logs or a record's ``error``: errors are
described by their type and our own words, with any URL removed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import re
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from multidict import CIMultiDict
from yarl import URL

from .config import Config
from .measure import RecordBuilder, is_measured
from .record import Record
from .tokens import Tokenizer

__all__ = ["LABEL_HEADER", "Proxy"]

log = logging.getLogger("specproxy.proxy")

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

MAX_PENDING_BUILDS = 10000  # turns waiting to be measured; past this a turn is forwarded but not measured
UPSTREAM_READ_BUFSIZE = 65536
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


def _strip(headers, drop: frozenset[str] | set[str]) -> CIMultiDict:
    """Copy headers without hop-by-hop ones, including any the Connection header names."""
    named = set()
    for value in headers.getall("Connection", ()):
        named.update(token.strip().lower() for token in value.split(","))
    out: CIMultiDict = CIMultiDict()
    for key, value in headers.items():
        low = key.lower()
        if low not in drop and low not in named:
            out.add(key, value)
    return out


def _error_response(status: int, kind: str, message: str, *, close: bool = False) -> web.Response:
    body = orjson.dumps({"error": {"message": f"specproxy: {message}", "type": kind, "code": status}})
    resp = web.Response(status=status, body=body, content_type="application/json")
    if close:
        resp.force_close()
    return resp


def _refuse(request: web.Request) -> web.Response | None:
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
    size = 0
    for name, value in request.raw_headers:
        size += len(name) + len(value) + 4
        if _BAD_HEADER_BYTES.search(value) or _BAD_HEADER_BYTES.search(name):
            return _error_response(400, "bad_request", "control character in a header", close=True)
        if not value.isascii():
            try:
                value.decode("utf-8")
            except UnicodeDecodeError:
                # aiohttp's client writes header values as UTF-8 and would silently drop these bytes:
                # refusing is honest, forwarding an altered header is not
                return _error_response(400, "bad_request", "a header value is not valid UTF-8 (obs-text): "
                                       "specproxy cannot forward it unchanged", close=True)
    if size > MAX_HEADER_BYTES:
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
        self._base = str(self.upstream.with_query(None).with_fragment(None)).rstrip("/")
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
        self._session: aiohttp.ClientSession | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specproxy-measure")
        self._idle = asyncio.Event()

    # --- lifecycle --------------------------------------------------------------------------------

    def make_app(self) -> web.Application:
        handler_args = {
            "max_field_size": MAX_FIELD_BYTES,
            "auto_decompress": False,  # a gzip request body is forwarded as it came, with its Content-Encoding
            # aiohttp closes a connection that has not sent a complete request within this long of the
            # previous response (and, in recent versions, of connecting; service.py also enforces that)
            "keepalive_timeout": self.cfg.header_timeout_s,
            "logger": http_log,
        }
        app = web.Application(client_max_size=self.cfg.max_body_bytes, handler_args=handler_args,
                              middlewares=[self._gate])
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.cfg.connect_timeout_s, sock_read=self.cfg.idle_timeout_s
        )
        connector = aiohttp.TCPConnector(limit=0, force_close=False, enable_cleanup_closed=True)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            auto_decompress=False,  # forward the upstream's bytes as they are
            # what one stream may buffer from the upstream while its client is not reading (reading
            # pauses at twice this): with the kernel's socket queues, that is the backpressure
            read_bufsize=UPSTREAM_READ_BUFSIZE,
            skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent", "Content-Type"),
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,  # never route through an environment proxy
        )

    async def _on_cleanup(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()
        await self.drain_measurements()
        await asyncio.to_thread(self._executor.shutdown, True)  # joining threads blocks: not on the loop

    async def drain_measurements(self, timeout: float = 30.0) -> None:
        """Wait until every finished turn has been measured and handed to the sink."""
        deadline = time.monotonic() + timeout
        while self._pending_builds and time.monotonic() < deadline:
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), max(deadline - time.monotonic(), 0.01))
            except asyncio.TimeoutError:
                break

    # --- the handler ------------------------------------------------------------------------------

    @web.middleware
    async def _gate(self, request: web.Request, handler) -> web.StreamResponse:
        """Runs before routing decides anything, so that requests no route matches (CONNECT's
        authority-form target, ``OPTIONS *``) are refused by the same rules."""
        refused = _refuse(request)
        if refused is not None:
            self.rejected_bad += 1
            return refused
        return await handler(request)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.in_flight >= self.cfg.max_concurrent:
            self.rejected_busy += 1
            return _error_response(503, "busy", f"more than {self.cfg.max_concurrent} requests in flight")
        self.in_flight += 1
        try:
            return await self._forward(request)
        finally:
            self.in_flight -= 1

    async def _read_body(self, request: web.Request) -> bytes | web.Response:
        """The whole body, or the error response: 413 over ``max_body_bytes``, 408 when it stalls."""
        limit = self.cfg.max_body_bytes
        declared = request.content_length
        if declared is not None and declared > limit:
            return _error_response(413, "body_too_large", f"request body over {limit} bytes", close=True)
        content = request.content
        parts: list[bytes] = []
        size = 0
        while True:
            try:
                async with asyncio.timeout(self.cfg.header_timeout_s):
                    data = await content.readany()
            except TimeoutError:
                return _error_response(408, "request_timeout",
                                       f"request body stalled for {self.cfg.header_timeout_s:g} s", close=True)
            except (RequestPayloadError, HttpProcessingError):
                return _error_response(400, "bad_request", "malformed request body", close=True)
            if not data:
                return b"".join(parts)
            size += len(data)
            if size > limit:
                return _error_response(413, "body_too_large", f"request body over {limit} bytes", close=True)
            parts.append(data)

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_body(request)
        if not isinstance(body, bytes):
            self.rejected_bad += 1
            if body.status == 408:  # the client stalled: answer and hang up now, not after lingering on
                await body.prepare(request)
                await body.write_eof()
                if request.transport is not None:
                    request.transport.close()
            return body  # nothing was sent upstream
        t_request = clock()
        path = request.rel_url.path
        builder = None
        if is_measured(request.method, path):
            self.measured_in_flight += 1
            self.turns_started += 1
            started_before = self.turns_started
            prev_done = self.last_turn_done
            builder = RecordBuilder(
                method=request.method,
                path=path,
                body=body,
                t_wall=time.time(),
                t_request=t_request,
                concurrency=self.measured_in_flight,
                label=request.headers.get(LABEL_HEADER) or self.cfg.label,
                instance_id=self.instance_id(),
                store_text=self.cfg.store_text,
                request_encoding=request.headers.get("Content-Encoding", ""),
            )
        try:
            return await self._relay(request, body, builder)
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

    async def _relay(self, request: web.Request, body: bytes, b: RecordBuilder | None) -> web.StreamResponse:
        assert self._session is not None
        url = URL(self._base + request.rel_url.raw_path_qs, encoded=True)
        headers = _strip(request.headers, _NOT_FORWARDED_UP)
        try:
            up = await self._session.request(
                request.method,
                url,
                headers=headers,
                data=body if body or request.method not in ("GET", "HEAD") else None,
                allow_redirects=False,
                compress=None,
            )
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            # refused or reset: 502; no connection within connect_timeout_s, or no response headers
            # within idle_timeout_s: 504. Either way the upstream gave no response to relay.
            status = 504 if isinstance(exc, asyncio.TimeoutError) else 502
            reason = _describe(exc, self.cfg)
            if b is not None:
                b.fail(clock(), "upstream_unreachable", status, reason)
            kind = "upstream_timeout" if status == 504 else "upstream_unreachable"
            return _error_response(status, kind, f"no response from the upstream: {reason}")
        try:
            t_headers = clock()
            if b is not None:
                b.on_headers(
                    t_headers, up.status, up.headers.get("Content-Type", ""), up.headers.get("Content-Encoding", "")
                )
            resp = web.StreamResponse(status=up.status, reason=up.reason, headers=_strip(up.headers, _NOT_FORWARDED_DOWN))
            if up.headers.get("Content-Length") is not None and "chunked" not in up.headers.get("Transfer-Encoding", ""):
                resp.headers["Content-Length"] = up.headers["Content-Length"]
            await resp.prepare(request)
            return await self._pump(request, up, resp, b)
        finally:
            up.close()

    async def _pump(
        self, request: web.Request, up: aiohttp.ClientResponse, resp: web.StreamResponse, b: RecordBuilder | None
    ) -> web.StreamResponse:
        """Relay read by read. The hot loop: read, stamp, write, stamp, append."""
        content = up.content
        try:
            while True:
                try:
                    data = await content.readany()
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    if b is not None:
                        b.finish(clock(), "upstream_truncated", _describe(exc, self.cfg))
                    _abort(request)  # the client must see the truncation: no invented end of stream
                    return resp
                if not data:
                    break
                t_read = clock()
                try:
                    await resp.write(data)
                except (ConnectionError, aiohttp.ClientConnectionResetError, RuntimeError) as exc:
                    if b is not None:
                        b.on_bytes(data, t_read, clock())
                        b.finish(clock(), "client_abort", _describe(exc))
                    return resp
                if b is not None:
                    b.on_bytes(data, t_read, clock())
            if b is not None:
                b.finish(clock())
            await resp.write_eof()
        except asyncio.CancelledError:
            # the client disconnected (aiohttp cancels the handler): close the upstream, keep the turn
            if b is not None and not b._ended:
                b.finish(clock(), "client_abort", "client disconnected")
            raise
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            pass  # the client left while we finished the response; the turn is already recorded
        return resp

    # --- measuring, off the forwarding path -----------------------------------------------------------

    def _submit(self, builder: RecordBuilder) -> None:
        if not builder._ended:  # e.g. cancelled while reading: still one record per turn
            builder.fail(clock(), "client_abort", None, "client disconnected before the response")
        if self._pending_builds >= MAX_PENDING_BUILDS:
            self.measure_dropped += 1
            return
        self._pending_builds += 1
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._executor, builder.build, self.tokenizer)
        fut.add_done_callback(functools.partial(self._built, builder))

    def _built(self, builder: RecordBuilder, fut: asyncio.Future) -> None:
        self._pending_builds -= 1
        if not self._pending_builds:
            self._idle.set()
        if fut.cancelled():
            self.measure_dropped += 1
            return
        exc = fut.exception()
        if exc is not None:
            # measuring failed (a bug, e.g. on input nobody foresaw): the turn still gets its row
            self.measure_errors += 1
            log.error("measuring a turn failed: %s (%s)", type(exc).__name__, _where(exc))
            self.sink(_unmeasured(builder, f"measuring failed: {type(exc).__name__} ({_where(exc)})"))
            return
        self.sink(fut.result())


def _abort(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]*")


def _where(exc: BaseException) -> str:
    """Where an exception was raised (file:line), for logs and records that must not quote its message."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f"raised at {frames[-1].filename}:{frames[-1].lineno}" if frames else "raised at ?"


def _describe(exc: BaseException, cfg: Config | None = None) -> str:
    """A short reason that never includes request content: the type and our own words, or the
    exception's message with every URL cut out (aiohttp puts the full URL, query string and all, in
    some messages, and a query string can carry an API key)."""
    name = type(exc).__name__
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        text = "no connection within connect_timeout_s" + (f" ({cfg.connect_timeout_s:g} s)" if cfg else "")
    elif isinstance(exc, aiohttp.ServerTimeoutError):
        text = "no byte from the upstream within idle_timeout_s" + (f" ({cfg.idle_timeout_s:g} s)" if cfg else "")
    elif isinstance(exc, aiohttp.ClientConnectorError):
        text = f"cannot connect to the upstream: {exc.strerror or type(exc.os_error).__name__}"
    else:
        text = _URL.sub("<url>", str(exc)) or name
    return f"{name}: {text}"[:300]


def _unmeasured(b: RecordBuilder, error: str) -> Record:
    """The row of a turn whose measuring failed: what the forwarding path knew, nothing derived."""
    return Record(
        id=getattr(b, "id", None) or uuid.uuid4().hex,
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
    )
