"""A response head from the upstream, parsed by llhttp (``httptools``) and vetted: sans I/O.

Why a maintained parser rather than our own: the head decides where the body ends and what the client
is told, so every leniency is a way for one response to look like two, or for a header to be smuggled
past the client's own parser. llhttp (the parser of Node.js) refuses what RFC 9112 forbids: bare CR or
LF line ends, NUL and other control characters in field values, obsolete line folding, malformed or
repeated Content-Length, bad field names. Two checks of ours are on top: the reason phrase (llhttp lets
control characters through there) and the HTTP version (only 1.0 and 1.1). One parse per response
costs a few microseconds; the body is never fed to it (the relay follows the body's framing itself).

Content-Length beside Transfer-Encoding is parsed, not refused (RFC 9112 6.3: Transfer-Encoding
overrides it); ``ResponseHead.transfer_encoding`` tells ``serve`` to drop the Content-Length. A transfer
coding other than ``chunked`` alone (``gzip``, ``gzip, chunked``, ``chunked, chunked``) is refused, as
nginx refuses it: the client could not be told the truth about the bytes it would get.
"""

from __future__ import annotations

import re

import httptools

from specproxy.errors import UpstreamError

__all__ = ["CHUNKED", "CLOSE", "LENGTH", "NO_BODY", "ResponseHead", "parse_head"]

# framing of a response body (RFC 9112 6.3)
NO_BODY, LENGTH, CHUNKED, CLOSE = "none", "length", "chunked", "close"

# RFC 9112 4: reason-phrase = *( HTAB / SP / VCHAR / obs-text ); llhttp lets other control bytes through
_BAD_REASON = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


class ResponseHead:
    """A parsed response head; ``headers`` are the (name, value) byte pairs as received, values stripped."""

    __slots__ = ("content_encoding", "content_type", "framing", "headers", "keep_alive", "length", "reason",
                 "status", "transfer_encoding", "version")

    def __init__(self, status: int, reason: bytes, version: bytes, headers: list[tuple[bytes, bytes]],
                 framing: str, length: int, keep_alive: bool, transfer_encoding: bool = False,
                 content_type: str = "", content_encoding: str = "") -> None:
        self.status = status
        self.reason = reason
        self.version = version
        self.headers = headers
        self.framing = framing
        self.length = length
        self.keep_alive = keep_alive
        self.transfer_encoding = transfer_encoding  # the head had a Transfer-Encoding field
        # the first Content-Type and Content-Encoding values, as text ("" without): what measuring reads
        self.content_type = content_type
        self.content_encoding = content_encoding


class _Collect:
    """llhttp's callbacks for one head: the fields and the reason phrase, nothing of the body."""

    __slots__ = ("complete", "headers", "reason")

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.reason = b""
        self.complete = False

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value.rstrip(b" \t")))

    def on_headers_complete(self) -> None:
        self.complete = True


def _comma_tokens(values: list[bytes]) -> list[bytes]:
    return [t.strip().lower() for v in values for t in v.split(b",") if t.strip()]


def parse_head(raw: bytes, method: str) -> ResponseHead:
    """Parse one response head: ``raw`` is the status line and fields up to and including the blank line
    that ends them (nothing after it). Raises ``UpstreamError`` when the head is malformed."""
    fields = _Collect()
    parser = httptools.HttpResponseParser(fields)
    parser.set_dangerous_leniencies(lenient_chunked_length=True)  # both framings: RFC 9112 6.3, see above
    try:
        parser.feed_data(raw)
    except httptools.HttpParserUpgrade:
        pass  # a 101 with Upgrade: the caller refuses it by its status
    except httptools.HttpParserError as exc:
        raise UpstreamError(f"malformed response head from the upstream ({exc})") from None
    if not fields.complete and parser.get_status_code() != 101:
        raise UpstreamError("malformed response head from the upstream (incomplete)")
    version = parser.get_http_version()
    if version not in ("1.1", "1.0"):
        raise UpstreamError(f"unsupported HTTP version from the upstream ({version[:8]})")
    if _BAD_REASON.search(fields.reason):
        raise UpstreamError("malformed response head from the upstream (control character in the reason phrase)")
    status = parser.get_status_code()
    headers = fields.headers
    lengths: list[bytes] = []
    codings: list[bytes] = []
    connection: list[bytes] = []
    content_type = content_encoding = None
    for name, value in headers:
        low = name.lower()
        if low == b"content-length":
            lengths.append(value)
        elif low == b"transfer-encoding":
            codings.append(value)
        elif low == b"connection":
            connection.append(value)
        elif low == b"content-type":
            if content_type is None:
                content_type = value
        elif low == b"content-encoding":
            if content_encoding is None:
                content_encoding = value
    keep_alive = version == "1.1" and not (connection and b"close" in _comma_tokens(connection))
    length = -1
    if method == "HEAD" or 100 <= status < 200 or status in (204, 304):
        framing = NO_BODY
    elif codings:
        # chunked alone, as nginx takes it: a body under another transfer coding (gzip, say) could be
        # passed on only by telling the client that coding, which HTTP/1.0 cannot and few clients decode
        if _comma_tokens(codings) != [b"chunked"]:
            raise UpstreamError("unsupported Transfer-Encoding from the upstream (only chunked is relayed)")
        framing = CHUNKED
    elif lengths:  # llhttp has refused a repeated or malformed one
        framing, length = LENGTH, int(lengths[0])
    else:
        framing = CLOSE
    if framing == CLOSE:
        keep_alive = False
    return ResponseHead(status, fields.reason, b"HTTP/" + version.encode(), headers, framing, length, keep_alive,
                        bool(codings), _latin(content_type), _latin(content_encoding))


def _latin(value: bytes | None) -> str:
    return value.decode("latin-1") if value is not None else ""
