"""HTTP/1.1 from the upstream, sans I/O: a response head parsed, and where a body ends (RFC 9112 6.3).

Why apart from ``upstream.py``: these are pure functions and small state machines over bytes (no
sockets, no loop), the relay's reference for what the C paths (``_chunked.h``) must do; each is tested
against every split of its input. ``upstream.py`` owns the connections that feed them.
"""

from __future__ import annotations

__all__ = [
    "CHUNKED",
    "CLOSE",
    "LENGTH",
    "MAX_LINE_BYTES",
    "NO_BODY",
    "ChunkedEnd",
    "FramingError",
    "ResponseHead",
    "parse_head",
]

from specproxy.errors import UpstreamError

MAX_LINE_BYTES = 4096  # a chunk-size or trailer line longer than this is malformed framing

# framing of a response body (RFC 9112 6.3)
NO_BODY, LENGTH, CHUNKED, CLOSE = "none", "length", "chunked", "close"

_HEX = b"0123456789abcdefABCDEF"
# RFC 9110 5.6.2: a field name is visible ASCII but for these delimiters; checked with one translate()
_TOKEN_CHARS = bytes(c for c in range(33, 127) if c not in b'"(),/:;<=>?@[\\]{}')


class FramingError(ValueError):
    """The upstream's body framing is malformed."""


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


class ChunkedEnd:
    """Follows chunked framing to find where the body ends, skipping payload without copying it.

    ``feed(data)`` returns -1 while the body goes on, else the index in ``data`` just past the body's
    last byte (the end of the trailer section). With ``collect=True`` the payload slices are kept in
    ``payload`` (for a client that cannot take chunked framing)."""

    __slots__ = ("_line", "_trailers", "payload", "rem")

    def __init__(self, collect: bool = False) -> None:
        self.rem = 0  # bytes of the current chunk (payload and its CRLF) still to skip
        self._line = b""  # a size or trailer line split across reads
        self._trailers = False
        self.payload: list[bytes] | None = [] if collect else None

    def feed(self, data: bytes) -> int:
        n = len(data)
        rem = self.rem
        payload = self.payload
        if rem >= n:  # the whole read is inside one chunk: the usual case for long chunks
            self.rem = rem - n
            if payload is not None and min(n, rem - 2) > 0:
                payload.append(data[: rem - 2])  # the chunk's payload, not its closing CRLF
            return -1
        if payload is not None and rem > 2:
            payload.append(data[: rem - 2])
        i = rem
        self.rem = 0
        while i < n:
            j = data.find(b"\n", i)
            if j < 0:
                self._line += data[i:]
                if len(self._line) > MAX_LINE_BYTES:
                    raise FramingError("a chunk-size line too long")
                return -1
            line = data[i:j]
            if self._line:
                line = self._line + line
                self._line = b""
            i = j + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if self._trailers:
                if not line:
                    return i
                continue
            size_text = line.split(b";", 1)[0].strip(b" \t")
            if not size_text or size_text.strip(_HEX) or len(size_text) > 15:
                raise FramingError("malformed chunk size")
            size = int(size_text, 16)
            if size == 0:
                self._trailers = True
                continue
            end = i + size + 2  # the payload and its CRLF
            if payload is not None:
                payload.append(data[i : min(i + size, n)])
            if end > n:
                self.rem = end - n
                return -1
            if data[end - 2 : end] != b"\r\n":
                raise FramingError("chunk payload not followed by CRLF")
            i = end
        return -1


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
