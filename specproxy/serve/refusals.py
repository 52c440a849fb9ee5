"""Answers of our own instead of the upstream's, and the checks on a request that decide them.

Why apart: both fronts (the lane, aiohttp's server) refuse with the same answers, and every check runs
before anything is forwarded, so a refused request never reaches the upstream. Ambiguous framing
(Transfer-Encoding other than a lone ``chunked``, with Content-Length, in HTTP/1.0; repeated
Content-Length), control characters in headers and HTTP versions other than 1.0/1.1 get 400; headers
over ``MAX_HEADER_BYTES`` in total get 431; a body over ``max_body_bytes`` gets 413; a body that stalls
for ``header_timeout_s``, or is not whole within ``body_timeout_s``, gets 408; more than
``max_concurrent`` requests in flight (counted once their body is whole) get 503. aiohttp's parser
rejects most malformed requests itself; ``refuse`` covers what it lets through (its pure-Python parser
is more lenient than its C one). The lane takes only requests none of these would refuse.
"""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import NamedTuple
from urllib.parse import unquote_to_bytes

import aiohttp
import orjson
from aiohttp import web

from specproxy.config import Config

__all__ = ["MAX_FIELD_BYTES", "MAX_HEADER_BYTES", "Refusal", "body_timeout", "busy", "climbs", "error_response",
           "out_of_base", "refuse"]

MAX_FIELD_BYTES = 16384  # one header line (aiohttp's parser answers 400 past it)
MAX_HEADER_BYTES = 65536  # all request headers together (431 past it; aiohttp only bounds each line and the count)
_BAD_HEADER_BYTES = re.compile(rb"[\x00\r\n]")


class Refusal(NamedTuple):
    """An answer of our own instead of the upstream's (the request was refused, or the upstream gave no
    response): an OpenAI-style JSON error. Each front writes it its own way (``as_response``, ``as_bytes``)."""

    status: int
    kind: str
    message: str
    close: bool = False

    def body(self) -> bytes:
        return orjson.dumps({"error": {"message": f"specproxy: {self.message}", "type": self.kind,
                                       "code": self.status}})

    def as_bytes(self, keep_alive: bool) -> bytes:
        """A whole HTTP/1.1 response, for a front that writes to the socket itself (the lane): what
        ``as_response`` sends through aiohttp."""
        body = self.body()
        try:
            reason = HTTPStatus(self.status).phrase.encode()
        except ValueError:
            reason = b"Error"
        close = b"" if keep_alive and not self.close else b"Connection: close\r\n"
        return b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
            self.status, reason, len(body), close, body)

    def as_response(self) -> web.Response:
        resp = web.Response(status=self.status, body=self.body(), content_type="application/json")
        if self.close:
            resp.force_close()
        return resp


def error_response(status: int, kind: str, message: str, *, close: bool = False) -> Refusal:
    return Refusal(status, kind, message, close)


def busy(cfg: Config) -> Refusal:
    return error_response(503, "busy", f"more than {cfg.max_concurrent} requests in flight")


def body_timeout(cfg: Config, whole: bool) -> Refusal:
    """408 for a request body that stalled (``header_timeout_s`` without a byte) or was not complete within
    ``body_timeout_s`` of its head (``whole``), whichever front read it."""
    why = (f"request body not complete within {cfg.body_timeout_s:g} s" if whole
           else f"request body stalled for {cfg.header_timeout_s:g} s")
    return error_response(408, "request_timeout", why, close=True)


def refuse(request: web.BaseRequest) -> Refusal | None:
    """Requests that must not be forwarded, decided from the request line and headers alone."""
    if request.method == "CONNECT":
        return error_response(405, "method_not_allowed", "CONNECT is not supported: this is a reverse proxy",
                               close=True)
    version = request.version
    if version != aiohttp.HttpVersion11 and version != aiohttp.HttpVersion10:
        return error_response(400, "bad_request", "only HTTP/1.0 and HTTP/1.1 are supported", close=True)
    headers = request.headers
    te = headers.getall("Transfer-Encoding", ())
    if te:
        # RFC 9112 6.1 and 6.3: chunked must be the only, final coding; TE with Content-Length or in
        # HTTP/1.0 is faulty framing. Both can smuggle a second request past a front end.
        if version == aiohttp.HttpVersion10 or len(te) != 1 or te[0].strip().lower() != "chunked":
            return error_response(400, "bad_request", "ambiguous or unsupported Transfer-Encoding", close=True)
        if "Content-Length" in headers:
            return error_response(400, "bad_request", "both Transfer-Encoding and Content-Length", close=True)
    if len(headers.getall("Content-Length", ())) > 1:
        return error_response(400, "bad_request", "more than one Content-Length", close=True)
    raw = request.raw_headers
    fields = [part for pair in raw for part in pair]
    if _BAD_HEADER_BYTES.search(b"\x01".join(fields)):  # one search over all names and values
        return error_response(400, "bad_request", "control character in a header", close=True)
    if sum(map(len, fields)) + 4 * len(raw) > MAX_HEADER_BYTES:
        return error_response(431, "headers_too_large", f"request headers over {MAX_HEADER_BYTES} bytes",
                               close=True)
    return None


# overlong UTF-8 encodings of "." and "/" (invalid UTF-8, but decoders that do not check, such as old
# servers' and some path normalisers', read them as the character): a segment of them is read as dots
_OVERLONG = re.compile(rb"\xc0[\xae\xaf]|\xe0\x80[\xae\xaf]|\xf0\x80\x80[\xae\xaf]")


def climbs(raw_path: str) -> bool:
    """Whether a request path (as sent, without the query) has a ``..`` segment as any server behind the
    proxy might read it: percent-escapes decoded (twice: ``%252e`` too), an overlong UTF-8 ``.`` or ``/``
    (``%c0%ae``, ``%c0%af``) as the character, a backslash as a slash, a segment's parameters dropped
    (``..;x``, as servlet containers read it)."""
    path = raw_path.encode("utf-8", "surrogateescape")
    for _ in range(2):
        if b"%" not in path:
            break
        path = unquote_to_bytes(path)
    if b"\xc0" in path or b"\xe0" in path or b"\xf0" in path:
        path = _OVERLONG.sub(lambda m: b"." if m.group()[-1] == 0xAE else b"/", path)
    return any(segment.partition(b";")[0] == b".." for segment in path.replace(b"\\", b"/").split(b"/"))


def out_of_base(raw_path: str) -> Refusal | None:
    """The upstream has a base path (``--upstream http://host/llm``): a client path with a ``..`` segment
    (``/../admin``, ``/%2e%2e/admin``, ``/v1/..;/..;/admin``) could reach past it, so it is refused (400),
    never forwarded: no client's request needs one. The lane reads no such path (it declines ``/.``, ``%``
    and ``\\``): aiohttp's front checks every path."""
    if not climbs(raw_path):
        return None
    return error_response(400, "bad_request", "a path with a '..' segment (the upstream's base path must hold)",
                          close=True)
