"""HTTP/1.1 from the upstream, sans I/O: a response head parsed, and where a body ends (RFC 9112 6.3).

Why apart from ``upstream.py``: these are pure functions and small state machines over bytes (no
sockets, no loop), each tested against every split of its input. A chunked body's end is found by the
one chunked-framing parser (``frames/chunked.py``'s ``ChunkedEnd``, or ``_chunked.h`` natively), not
here. ``upstream.py`` owns the connections that feed them.
"""

from __future__ import annotations

__all__ = [
    "CHUNKED",
    "CLOSE",
    "LENGTH",
    "NO_BODY",
    "ChunkedEnd",
    "FramingError",
    "ResponseHead",
    "parse_head",
]

from specproxy.errors import UpstreamError
from specproxy.frames.chunked import ChunkedEnd, FramingError  # the chunked-framing parser (its reference)

# framing of a response body (RFC 9112 6.3)
NO_BODY, LENGTH, CHUNKED, CLOSE = "none", "length", "chunked", "close"

# RFC 9110 5.6.2: a field name is visible ASCII but for these delimiters; checked with one translate()
_TOKEN_CHARS = bytes(c for c in range(33, 127) if c not in b'"(),/:;<=>?@[\\]{}')


class ResponseHead:
    """A parsed response head; ``headers`` are the raw (name, value) byte pairs as received."""

    __slots__ = ("framing", "headers", "keep_alive", "length", "reason", "status", "version")

    def __init__(self, status: int, reason: bytes, version: bytes, headers: list[tuple[bytes, bytes]],
                 framing: str, length: int, keep_alive: bool) -> None:
        self.status = status
        self.reason = reason
        self.version = version
        self.headers = headers
        self.framing = framing
        self.length = length
        self.keep_alive = keep_alive

    def get(self, name: bytes) -> bytes | None:
        """The first value of a header (``name`` in lower case), or None."""
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None


def _comma_tokens(values: list[bytes]) -> list[bytes]:
    return [t.strip().lower() for v in values for t in v.split(b",") if t.strip()]


def parse_head(raw: bytes, method: str) -> ResponseHead:
    """Parse a status line and header fields (``raw`` without the blank line that ends them).

    Strict where leniency could mislead about framing (obs-fold, conflicting Content-Length, bad field
    names), lenient where it cannot (bare LF line ends, any reason phrase, any bytes in values)."""
    lines = raw.split(b"\n")
    status_line = lines[0].rstrip(b"\r")
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0") or len(parts[1]) != 3 or not parts[1].isdigit():
        raise UpstreamError("malformed status line from the upstream")
    version, status = parts[0], int(parts[1])
    reason = parts[2] if len(parts) > 2 else b""
    headers: list[tuple[bytes, bytes]] = []
    lengths: list[bytes] = []
    codings: list[bytes] = []
    connection: list[bytes] = []
    for line in lines[1:]:
        line = line.rstrip(b"\r")
        if not line:
            continue
        if line[0] in b" \t":
            raise UpstreamError("obsolete line folding in a response header from the upstream")
        name, sep, value = line.partition(b":")
        if not sep or not name or name.translate(None, _TOKEN_CHARS):  # anything left is not a token char
            raise UpstreamError("malformed response header from the upstream")
        value = value.strip(b" \t")
        headers.append((name, value))
        low = name.lower()
        if low == b"content-length":
            lengths.append(value)
        elif low == b"transfer-encoding":
            codings.append(value)
        elif low == b"connection":
            connection.append(value)
    conn_tokens = _comma_tokens(connection)
    keep_alive = version == b"HTTP/1.1" and b"close" not in conn_tokens
    length = -1
    if method == "HEAD" or 100 <= status < 200 or status in (204, 304):
        framing = NO_BODY
    elif codings:
        coding = _comma_tokens(codings)
        # chunked last: chunked framing; any other final coding: the body runs until close
        framing = CHUNKED if coding and coding[-1] == b"chunked" else CLOSE
    elif lengths:
        values = {v.strip() for v in b",".join(lengths).split(b",")}
        if len(values) != 1:
            raise UpstreamError("conflicting Content-Length from the upstream")
        (value,) = values
        if not value.isdigit() or len(value) > 18:
            raise UpstreamError("malformed Content-Length from the upstream")
        framing, length = LENGTH, int(value)
    else:
        framing = CLOSE
    if framing == CLOSE:
        keep_alive = False
    return ResponseHead(status, reason, version, headers, framing, length, keep_alive)


class _Length:
    """A Content-Length body: ends after ``rem`` more bytes."""

    __slots__ = ("payload", "rem")

    def __init__(self, length: int) -> None:
        self.rem = length
        self.payload = None

    def feed(self, data: bytes) -> int:
        self.rem -= len(data)
        return -1 if self.rem > 0 else len(data) + self.rem


class _UntilClose:
    __slots__ = ("payload",)

    def __init__(self) -> None:
        self.payload = None

    def feed(self, data: bytes) -> int:
        return -1
