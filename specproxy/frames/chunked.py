"""HTTP/1.1 chunked framing in Python: the parser's reference, and the framing taken off relayed reads.

Why: the proxy passes the upstream's chunked framing through to the client byte for byte (no
re-framing on the forwarding path), so a ``TurnRecorder`` sees framed reads. Measuring needs the
payload, and it needs it *per read*: an event is timed by the read that completed it, so the output is
aligned 1:1 with the input (a read that carried only framing gives ``b""``).

``ChunkedEnd`` is the one parser, fed read by read because a frame's size line, data and CRLF can be
split across reads anywhere; the relay uses it (or its native twin, ``_chunked.h``) to find where a body
ends and to refuse malformed framing, and ``dechunk_reads`` uses it to take the payload out. Both apply
the same strict rules (see ``_chunked.h``): what the relay refused, measuring reports the same way. A
stream cut short yields what arrived (``complete`` is False); malformed framing stops decoding there,
the remaining reads give ``b""`` and ``error`` says what was wrong, so the Record can say so.

With ``_scanc`` built, ``join_reads`` takes the framing off a stream in one native pass (the
relay's parser, ``_chunked.h``) and ``dechunk_reads`` is its reference (``tests/unit/test_chunked.py``
holds them equal), what reads every other body, and what says what is wrong with malformed framing.
"""

from __future__ import annotations

import re
from collections.abc import Callable

__all__ = ["MAX_LINE_BYTES", "ChunkedEnd", "Dechunked", "FramingError", "dechunk_reads", "join_reads", "scans"]

try:  # the per-chunk scans in C (setup.py; optional); measure/fast_texts.py takes them from here too
    from specproxy.frames import _scanc as scans
except ImportError:  # no C compiler at install: the Python references read every turn, same results
    scans = None

_HEX = b"0123456789abcdefABCDEF"
MAX_LINE_BYTES = 4096  # a chunk-size or trailer line's most bytes, CRLF aside (_chunked.h's CHUNKED_MAX_LINE)
_MAX_DIGITS = 15

# what is wrong, in the same words as _chunked.h
TOO_LONG = "a chunk-size or trailer line over 4096 bytes"
BARE_LF = "a chunk-size or trailer line not ended by CRLF"
BARE_CR = "a bare CR in a chunk-size or trailer line"
BAD_SIZE = "malformed chunk size"
NO_CRLF = "chunk data not followed by CRLF"
BAD_EXT = "malformed chunk extension"
BAD_TRAILER = "malformed trailer field"
AFTER_END = "bytes after the last chunk"

# RFC 9112 7.1.1 chunk-ext from its first ";" (the BWS before it is the size's), and a trailer line as a
# header field (RFC 9110 5.1, 5.5: token ":" value with no control byte but HTAB): _chunked.h's
# chunked_ext_ok and chunked_trailer_ok. Each whitespace run has one place to go, so a match is linear.
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_QUOTED = rb'"(?:[\t \x21\x23-\x5b\x5d-\x7e\x80-\xff]|\\[\t \x21-\x7e\x80-\xff])*"'
_EXT = re.compile(rb"(?:;[ \t]*%s[ \t]*(?:=[ \t]*(?:%s|%s)[ \t]*)?)*" % (_TOKEN, _TOKEN, _QUOTED))
_TRAILER = re.compile(rb"%s:[\t\x20-\x7e\x80-\xff]*" % _TOKEN)


class FramingError(ValueError):
    """The body's chunked framing is malformed."""


def _line_size(line: bytes, trailers: bool) -> int:
    """A complete line (without its LF) checked: its chunk size (0 for a trailer line), or FramingError."""
    cr = line[-1:] == b"\r"
    if len(line) - cr > MAX_LINE_BYTES:
        raise FramingError(TOO_LONG)
    if not cr:
        raise FramingError(BARE_LF)
    line = line[:-1]
    if b"\r" in line:
        raise FramingError(BARE_CR)
    if trailers:
        if line and _TRAILER.fullmatch(line) is None:
            raise FramingError(BAD_TRAILER)
        return 0
    size, semi, ext = line.partition(b";")
    size = size.rstrip(b" \t")
    if not size or len(size) > _MAX_DIGITS or size.translate(None, _HEX):
        raise FramingError(BAD_SIZE)
    if semi and _EXT.fullmatch(line, len(line) - len(ext) - 1) is None:
        raise FramingError(BAD_EXT)
    return int(size, 16)


class ChunkedEnd:
    """The chunked-framing parser's reference (``_chunked.h`` is the native one: same rules, same messages).

    ``feed(data)`` returns -1 while the body goes on, else the index in ``data`` just past the body's last
    byte (the end of the trailer section); malformed framing raises ``FramingError`` (see ``_chunked.h``
    for the rules and why they are strict). With ``collect=True`` the payload slices are appended to
    ``payload`` as they are passed, those before an error included."""

    __slots__ = ("_line", "_trailers", "payload", "rem")

    def __init__(self, collect: bool = False) -> None:
        self.rem = 0  # bytes of the current chunk (payload and its CRLF) still due
        self._line = b""  # a size or trailer line begun in an earlier read
        self._trailers = False
        self.payload: list[bytes] | None = [] if collect else None

    def feed(self, data: bytes) -> int:
        n = len(data)
        payload = self.payload
        i = 0
        rem = self.rem
        while True:
            if rem:  # in a chunk: its payload, then its CRLF
                avail = n - i
                if rem - 2 >= avail:  # the rest of the read is payload
                    if payload is not None and avail:
                        payload.append(data[i:])
                    self.rem = rem - avail
                    return -1
                if payload is not None and rem > 2:
                    payload.append(data[i : i + rem - 2])
                crlf = i + rem - 2  # where the CRLF starts (before this read when it began earlier)
                lo, hi = max(i, crlf), min(n, crlf + 2)
                if data[lo:hi] != b"\r\n"[lo - crlf : hi - crlf]:
                    raise FramingError(NO_CRLF)
                if rem > avail:
                    self.rem = rem - avail
                    return -1
                i += rem
                rem = 0
            self.rem = 0
            if i >= n:
                return -1
            j = data.find(b"\n", i)
            if j < 0:  # the line goes on in the next read
                line = self._line + data[i:]
                if len(line) - (line[-1:] == b"\r") > MAX_LINE_BYTES:
                    raise FramingError(TOO_LONG)
                self._line = line
                return -1
            line = self._line + data[i:j] if self._line else data[i:j]
            self._line = b""
            i = j + 1
            size = _line_size(line, self._trailers)
            if self._trailers:
                if len(line) == 1:  # the empty line: the body ends here
                    return i
            elif size:
                rem = size + 2
            else:
                self._trailers = True


class Dechunked(list):
    """The payload of each read (a ``list[bytes]``), with what the framing said about the body.

    ``error``: why decoding stopped, or ``None`` when the framing was well formed.
    ``complete``: the last chunk and the trailer section arrived (the body ended properly).
    """

    error: str | None = None
    complete: bool = False


def dechunk_reads(reads: list[bytes]) -> Dechunked:
    """For each raw read, the payload bytes it carried (framing removed), aligned 1:1 with ``reads``."""
    return _stepwise(reads, Dechunked())


def join_reads(reads: list[bytes], chunked: bool, let_go: Callable[[], None] | None = None,
               ) -> tuple[bytes, list[int], bool] | None:
    """``(payload, ends, complete)``: the reads joined, read i's payload ending at ``ends[i]``; with
    ``chunked``, their framing removed (``dechunk_reads`` joined) and ``complete`` whether the last chunk
    arrived. It consumes ``reads``: each read is let go of as soon as it is copied and the list is left
    empty, so a large body is held about once while it is joined, not twice: ``let_go`` (the process's
    way to give freed heap pages back to the system, ``wire.memory.trim``) is called after every 16 MiB
    of reads let go of, since the allocator keeps them otherwise. By the native parser when
    ``_scanc`` is built (``scans.join_frames``); otherwise, or when the framing is malformed, None with
    ``reads`` untouched (``dechunk_reads`` then decides, and says what is wrong)."""
    if scans is None:
        return None
    return scans.join_frames(reads, chunked, let_go)


def _stepwise(reads: list[bytes], out: Dechunked) -> Dechunked:
    """``reads`` from the start of a frame through the parser, their payloads appended to ``out``."""
    parser = ChunkedEnd(collect=True)
    payload = parser.payload
    error = None
    ended = False
    for data in reads:
        if ended or error is not None:
            if ended and data and error is None:
                error = AFTER_END
            out.append(b"")
            continue
        try:
            end = parser.feed(data)
        except FramingError as exc:
            error = str(exc)
        else:
            if end >= 0:
                ended = True
                if end < len(data):
                    error = AFTER_END
        out.append(payload[0] if len(payload) == 1 else b"".join(payload))
        payload.clear()
    out.error = error
    out.complete = ended and error is None
    return out
