"""Removing HTTP/1.1 chunked framing from reads relayed verbatim.

Why: the proxy passes the upstream's chunked framing through to the client byte for byte (no
re-framing on the forwarding path), so a ``RecordBuilder`` sees framed reads. Measuring needs the
payload, and it needs it *per read*: an event is timed by the read that completed it, so the output is
aligned 1:1 with the input (a read that carried only framing gives ``b""``).

The definition is a small state machine fed read by read (``_stepwise``), because a frame's size line,
data and CRLF can be split across reads anywhere. It is tolerant the way a measuring tool should be: a
stream cut short yields what arrived (``complete`` is False); framing that is not HTTP/1.1 chunked (a
bad size, missing CRLF after the data, bytes after the last chunk) stops decoding there, the remaining
reads give ``b""`` and ``error`` says what was wrong, so the Record can say so instead of guessing.
Chunk extensions (``;name=value``) are skipped, and trailer fields after the last chunk are read and
ignored. A lone LF is accepted where CRLF is due (as lenient HTTP parsers do); a size line or trailer
longer than 64 KiB is malformed.

Most streams are one whole frame per read (an engine writes one per token) and then the last chunk.
That shape is checked and cut for all reads but the last at once, with ``map`` over C methods
(``_whole_frames``): a Python step per read costs as much as the rest of measuring the chunk. Anything
else (a read holding two frames or part of one, an extension, a lone LF) goes to the state machine
from the start, which gives the same result for the common shape too (``tests/unit/test_chunked.py``).
"""

from __future__ import annotations

from itertools import repeat
from operator import getitem

__all__ = ["Dechunked", "dechunk_reads", "join_whole_frames"]

try:  # the per-chunk scans in C (setup.py; optional); texts.py takes them from here
    from specproxy.frames import _scanc
except ImportError:  # no C compiler at install: the Python paths, same results
    _scanc = None

_HEX = b"0123456789abcdefABCDEF"
_MAX_LINE = 64 * 1024

# states
_SIZE = 0  # reading a chunk-size line (size, extensions, CRLF)
_DATA = 1  # inside chunk data
_DATA_CR = 2  # after chunk data: expecting CRLF
_DATA_LF = 3  # after chunk data and its CR: expecting LF
_TRAILER = 4  # after the last chunk: trailer field lines until an empty line
_END = 5  # the body ended
_BAD = 6  # malformed: nothing more is decoded


class Dechunked(list):
    """The payload of each read (a ``list[bytes]``), with what the framing said about the body.

    ``error``: why decoding stopped, or ``None`` when the framing was well formed.
    ``complete``: the last chunk and the trailer section arrived (the body ended properly).
    """

    error: str | None = None
    complete: bool = False


def dechunk_reads(reads: list[bytes]) -> Dechunked:
    """For each raw read, the payload bytes it carried (framing removed), aligned 1:1 with ``reads``."""
    payloads = _whole_frames(reads[:-1])
    if payloads is None:
        return _stepwise(reads, Dechunked())
    return _stepwise(reads[-1:], Dechunked(payloads))  # after whole frames: the state machine's start


def join_whole_frames(reads: list[bytes]) -> tuple[bytes, list[int], bool] | None:
    """``(payload, ends, complete)``: ``dechunk_reads`` joined (read i's payload ends at ``ends[i]``),
    when the C scan is built and every frame is whole within its read with no extension or trailer
    (``_scanc.join_frames``); otherwise None, and ``dechunk_reads`` decides."""
    if _scanc is None:
        return None
    return _scanc.join_frames(reads)


def _whole_frames(reads: list[bytes]) -> list[bytes] | None:
    """The payloads if every read is exactly one whole frame of a non-empty chunk, ``<hex>CRLF<payload>CRLF``,
    else None. Each check is one C call over all the reads, none is a Python step per read."""
    if not reads:
        return None
    sizes, _, rests = zip(*map(bytes.partition, reads, repeat(b"\r\n")))  # no CRLF: all size, no data
    digits = b"".join(sizes)
    if b"" in sizes or digits.translate(None, _HEX) or len(digits) > _MAX_LINE:
        return None  # no size, not hex (an extension, a sign, a space, a LF), or too long
    lengths = list(map(int, sizes, repeat(16)))
    payloads = list(map(getitem, rests, repeat(slice(None, -2))))
    if 0 in lengths or list(map(len, payloads)) != lengths or not all(map(bytes.endswith, rests, repeat(b"\r\n"))):
        return None  # the last chunk, or data not of the size given, or not followed by CRLF
    return payloads


def _stepwise(reads: list[bytes], out: Dechunked) -> Dechunked:
    """The state machine: ``reads`` from the start of a frame, their payloads appended to ``out``."""
    state = _SIZE
    line = b""  # a size or trailer line that started in an earlier read
    remaining = 0  # bytes of chunk data still due
    error = None
    for data in reads:
        if state >= _END:
            if state == _END and data:
                state, error = _BAD, "bytes after the last chunk"
            out.append(b"")
            continue
        n = len(data)
        if state == _SIZE and not line:
            # the common read: exactly one whole frame "<hex>\r\n<payload>\r\n" (no extension)
            lf = data.find(b"\n", 0, 20)
            if lf > 0:
                size = data[: lf - 1] if data[lf - 1] == 13 else data[:lf]
                if size and not size.lstrip(_HEX):
                    end = lf + 1 + int(size, 16)
                    if end > lf + 1 and n == end + 2 and data[end:] == b"\r\n":
                        out.append(data[lf + 1 : end])
                        continue
        pieces: list[bytes] = []
        pos = 0
        while pos < n:
            if state == _DATA:
                end = pos + remaining
                if end <= n:
                    pieces.append(data[pos:end])
                    pos = end
                    remaining = 0
                    state = _DATA_CR
                else:
                    pieces.append(data[pos:])
                    remaining -= n - pos
                    pos = n
            elif state == _SIZE or state == _TRAILER:
                lf = data.find(b"\n", pos)
                if lf == -1:
                    line += data[pos:]
                    pos = n
                    if len(line) > _MAX_LINE:
                        state, error = _BAD, "a chunk-size or trailer line longer than 64 KiB"
                    break
                text = line + data[pos:lf] if line else data[pos:lf]
                line = b""
                pos = lf + 1
                if text[-1:] == b"\r":
                    text = text[:-1]
                if len(text) > _MAX_LINE:
                    state, error = _BAD, "a chunk-size or trailer line longer than 64 KiB"
                    break
                if state == _TRAILER:
                    if not text:
                        state = _END
                        if pos < n:
                            state, error = _BAD, "bytes after the last chunk"
                        break
                    continue  # a trailer field: not needed for measuring
                size = text.split(b";", 1)[0].strip(b" \t")
                if not size or size.lstrip(_HEX):
                    state, error = _BAD, f"bad chunk-size line {text[:40]!r}"
                    break
                remaining = int(size, 16)
                state = _DATA if remaining else _TRAILER
            elif state == _DATA_CR:
                byte = data[pos]
                pos += 1
                if byte == 13:  # CR
                    state = _DATA_LF
                elif byte == 10:  # a lone LF, accepted
                    state = _SIZE
                else:
                    state, error = _BAD, "chunk data not followed by CRLF"
                    break
            else:  # _DATA_LF
                if data[pos] != 10:
                    state, error = _BAD, "chunk data not followed by CRLF"
                    break
                pos += 1
                state = _SIZE
        out.append(pieces[0] if len(pieces) == 1 else b"".join(pieces))
    out.error = error
    out.complete = state == _END
    return out
