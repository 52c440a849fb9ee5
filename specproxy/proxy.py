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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web
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
_NOT_FORWARDED_UP = _HOP_BY_HOP | {"host", "content-length", LABEL_HEADER.lower()}
_NOT_FORWARDED_DOWN = _HOP_BY_HOP

MAX_PENDING_BUILDS = 10000  # turns waiting to be measured; past this a turn is forwarded but not measured

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


def _error_response(status: int, kind: str, message: str) -> web.Response:
    body = orjson.dumps({"error": {"message": f"specproxy: {message}", "type": kind, "code": status}})
    return web.Response(status=status, body=body, content_type="application/json")


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
        self._pending_builds = 0
        self._session: aiohttp.ClientSession | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specproxy-measure")
        self._idle = asyncio.Event()

    # --- lifecycle --------------------------------------------------------------------------------

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, handler_args={"max_field_size": 16384})
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

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method == "CONNECT":
            return _error_response(405, "method_not_allowed", "CONNECT is not supported: this is a reverse proxy")
        if self.in_flight >= self.cfg.max_concurrent:
            self.rejected_busy += 1
            return _error_response(503, "busy", f"more than {self.cfg.max_concurrent} requests in flight")
        self.in_flight += 1
        try:
            return await self._forward(request)
        finally:
            self.in_flight -= 1

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()  # bounded by client_max_size: a larger body gets 413, upstream untouched
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
            )
        try:
            return await self._relay(request, body, builder)
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
            reason = _describe(exc)
            if b is not None:
                b.fail(clock(), "upstream_unreachable", 502, reason)
            return _error_response(502, "upstream_unreachable", f"upstream unreachable: {reason}")
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
                        b.finish(clock(), "upstream_truncated", _describe(exc))
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
        fut.add_done_callback(self._built)

    def _built(self, fut: asyncio.Future) -> None:
        self._pending_builds -= 1
        if not self._pending_builds:
            self._idle.set()
        if fut.cancelled():
            self.measure_dropped += 1
            return
        exc = fut.exception()
        if exc is not None:
            self.measure_errors += 1
            log.error("measuring a turn failed: %s: %s", type(exc).__name__, exc)
            return
        self.sink(fut.result())


def _abort(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()


def _describe(exc: BaseException) -> str:
    """A short reason that never includes request content (headers, bodies): type and message."""
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]
