"""HTTP/1.1 from the upstream, sans I/O: where a response body ends (RFC 9112 6.3); its head is
``response_head.py``'s.

Why apart from ``upstream.py``: these are pure functions and small state machines over bytes (no
sockets, no loop), the relay's reference for what the C paths (``_chunked.h``) must do; each is tested
against every split of its input. ``upstream.py`` owns the connections that feed them.
"""

from __future__ import annotations

__all__ = ["MAX_LINE_BYTES", "ChunkedEnd", "FramingError"]

MAX_LINE_BYTES = 4096  # a chunk-size or trailer line longer than this is malformed framing

_HEX = b"0123456789abcdefABCDEF"


class FramingError(ValueError):
    """The upstream's body framing is malformed."""


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
