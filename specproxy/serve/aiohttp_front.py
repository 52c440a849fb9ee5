"""aiohttp's low-level server as a front: every request the lane declines, read, vetted and forwarded.

Why it is there: the lane (``lane.py``) takes only the common, plainly well-formed request; any other
(chunked bodies, ``Expect``, HTTP/1.0, anything odd) is handed from its first byte to aiohttp's server,
whose parsers are strict and whose refusals, with ``refusals.refuse``'s checks on top, keep an ambiguous
request from reaching the upstream. Each request it accepts goes to ``Proxy.exchange`` like the lane's.

Nothing a client sent (headers, query, body) reaches the logs: aiohttp's own log lines about a
malformed request keep the exception's type and where it was raised, not its message. And anyone who can
connect can send malformed requests: each is counted (``rejected_bad``), and said in one WARNING line at
most once per ``MALFORMED_LINE_EVERY_S``, with how many came since the last (``_ServerLog``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from specproxy.serve.admin import reserved
from specproxy.serve.headers import LABEL_HEADER
from specproxy.serve.incoming import Incoming
from specproxy.serve.proxy import SMALL_BODY, where
from specproxy.serve.refusals import MAX_FIELD_BYTES, Refusal, body_timeout, error_response, out_of_base, refuse

if TYPE_CHECKING:
    from specproxy.serve.proxy import Proxy

__all__ = ["AiohttpFront"]

http_log = logging.getLogger("specproxy.http")


class _NoRequestContent(logging.Filter):
    """aiohttp logs a malformed request with its offending bytes, and a header line can hold an API key:
    keep the exception's type and where it was raised, drop its message and arguments."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            status = getattr(exc, "code", None) or getattr(exc, "status", None)
            record.msg = f"{record.getMessage()}: {type(exc).__name__}{f' {status}' if status else ''} ({where(exc)})"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


http_log.addFilter(_NoRequestContent())

MALFORMED_LINE_EVERY_S = 60.0  # at most one line per this long about malformed requests (each is counted)


class _ServerLog(logging.LoggerAdapter):
    """The logger aiohttp's server gets, one per front: a request its parser refused (an
    ``HttpProcessingError``: aiohttp answered 400 and logged it, at ERROR but for a first line that is not
    HTTP at all) is counted in the proxy's ``rejected_bad`` and said as a WARNING at most once per
    ``MALFORMED_LINE_EVERY_S``, with how many came since the last line; everything else goes to
    ``http_log`` as it came (a bug of ours is still an ERROR)."""

    def __init__(self, proxy: Proxy) -> None:
        super().__init__(http_log, {})
        self.proxy = proxy
        self.unsaid = 0  # malformed requests since the last line about them
        self.next_line_at = 0.0  # monotonic

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if isinstance(exc, tuple):
            exc = exc[1]
        if not isinstance(exc, HttpProcessingError):
            super().log(level, msg, *args, **kwargs)
            return
        self.proxy.counters.rejected("bad")
        self.unsaid += 1
        now = time.monotonic()
        if now < self.next_line_at:
            return
        self.next_line_at = now + MALFORMED_LINE_EVERY_S
        count, self.unsaid = self.unsaid, 0
        peer = f" from {args[0]}" if args else ""
        self.logger.warning("malformed request%s answered 400: %s %s (%s); %d since the last such line (one line "
                            "at most every %g s; specproxy_rejected_bad_total counts them all)", peer,
                            type(exc).__name__, exc.code, where(exc), count, MALFORMED_LINE_EVERY_S)


class AiohttpFront:
    """aiohttp's server for one ``Proxy``: ``make_server`` is what the service listens with."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self._based = bool(proxy.upstream.raw_path.strip("/"))  # the upstream has a base path to stay under

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
            keepalive_timeout=self.proxy.cfg.header_timeout_s,
            logger=_ServerLog(self.proxy),
        )

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """aiohttp's server: every request the lane (``lane.py``) did not take."""
        proxy = self.proxy
        refused = refuse(request)  # before anything else, e.g. CONNECT's authority-form target
        if refused is not None:
            proxy.counters.rejected("bad")
            return refused.as_response()
        if reserved(request.rel_url.raw_path):  # specproxy's own pages: never forwarded (admin.py)
            return await proxy.admin(request) if proxy.admin is not None else _not_here()
        if self._based:
            refused = out_of_base(request.rel_url.raw_path)
            if refused is not None:
                proxy.counters.rejected("bad")
                return refused.as_response()
        body = await self._read_body(request)  # not counted in flight yet: a slow body holds no one's place
        if not isinstance(body, bytes):
            if body.kind != "memory_budget":  # (counted apart, as rejected_memory)
                proxy.counters.rejected("bad")
            resp = body.as_response()
            if body.status == 408:  # the client stalled: answer and hang up now, not after lingering on
                await resp.prepare(request)
                await resp.write_eof()
                if request.transport is not None:
                    request.transport.close()
            return resp  # nothing was sent upstream
        client = _AiohttpClient(request)
        refusal = await proxy.exchange(_incoming(request), body, client)
        return refusal.as_response() if refusal is not None else client.response

    async def _read_body(self, request: web.BaseRequest) -> bytes | Refusal:
        """The whole body, charged to the memory budget (``Proxy.admit_body``: a declared length before
        a byte of it is read, a chunked body read by read), or the refusal, with nothing charged: 413 over
        ``max_body_bytes``, 503 past the memory budget, 408 when it stalls."""
        proxy = self.proxy
        limit = proxy.cfg.max_body_bytes
        declared = request.content_length
        if declared is not None and declared > limit:
            return error_response(413, "body_too_large", f"request body over {limit} bytes", close=True)
        if declared and not proxy.admit_body(declared):
            return proxy.memory_full(declared)
        charged = [declared or 0]
        try:
            body = await self._read_charged(request, limit, charged)
        except BaseException:  # cancelled: the client hung up
            proxy.release_body(charged[0])
            raise
        if not isinstance(body, bytes):
            proxy.release_body(charged[0])
        elif charged[0] != len(body):  # the exchange's charge is its body's length
            proxy.release_body(charged[0] - len(body))
        return body

    async def _read_charged(self, request: web.BaseRequest, limit: int, charged: list[int]) -> bytes | Refusal:
        proxy = self.proxy
        expect = request.headers.get("Expect")
        if expect is not None and request.version == aiohttp.HttpVersion11:
            if expect.lower() != "100-continue":
                return error_response(417, "expectation_failed", "only Expect: 100-continue is understood",
                                      close=True)
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # the client may send the body now
            request.writer.output_size = 0  # an interim response is not part of the answer's size
        content = request.content
        if content.is_eof():  # the whole body came with the head (the usual case): no wait, no deadline
            try:
                data = content.read_nowait(-1)
            except (RequestPayloadError, HttpProcessingError):
                return error_response(400, "bad_request", "malformed request body", close=True)
            if len(data) > limit:
                return error_response(413, "body_too_large", f"request body over {limit} bytes", close=True)
            if charged[0] < len(data):
                if not proxy.admit_body(len(data) - charged[0]):
                    return proxy.memory_full(len(data))
                charged[0] = len(data)
            return data
        parts: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        whole_by = loop.time() + proxy.cfg.body_timeout_s
        while True:
            stall_by = loop.time() + proxy.cfg.header_timeout_s
            try:
                async with asyncio.timeout_at(min(stall_by, whole_by)):
                    data = await content.readany()
            except TimeoutError:
                return body_timeout(proxy.cfg, whole_by <= stall_by)
            except (RequestPayloadError, HttpProcessingError):
                return error_response(400, "bad_request", "malformed request body", close=True)
            if not data:
                return b"".join(parts)
            size += len(data)
            if size > limit:
                return error_response(413, "body_too_large", f"request body over {limit} bytes", close=True)
            if size > charged[0]:  # a chunked body: charged read by read, refused once the budget is full
                if not proxy.admit_body(size - charged[0], large=size > SMALL_BODY):
                    return proxy.memory_full(size)
                charged[0] = size
            parts.append(data)


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


def _abort(request: web.BaseRequest) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()


def _not_here() -> web.Response:
    return error_response(404, "not_found", "nothing here (specproxy's reserved prefix)").as_response()
