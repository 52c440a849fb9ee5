"""``read_response``: the kept reads of one response, turned into what it delivered.

Why apart from ``build.py``: this is where one large response would cost its size twice (the reads, and
their joined copy), so it is written to hold it about once. The reads are consumed as they are joined
(``frames.chunked.join_reads``: each read let go of once copied, freed heap pages given back every 16
MiB), an encoded read is let go of once inflated, and the joined payload goes when this returns, before
``build_record`` counts tokens (docs/operations.md, "Memory"). The order: take the chunked framing off
(``join_reads`` in C, else ``dechunk_reads``, which also says what is wrong with malformed framing),
undo a Content-Encoding, then read with the API's stream or body reader.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from itertools import accumulate

from specproxy.frames.chunked import dechunk_reads, join_reads
from specproxy.measure.apis import Api
from specproxy.measure.texts import Texts, body_accounting, body_texts

__all__ = ["read_response"]

_INFLATED = ("gzip", "deflate", "x-gzip")


def read_response(reads: list[bytes], times: list[float], api: Api, *, streamed: bool, chunked: bool,
                  content_encoding: str, fast: bool = True, let_go: Callable[[], None] | None = None,
                  max_parsed: int | None = None) -> tuple[Texts, int, str | None]:
    """What the response delivered, its payload's size (framing removed, encoding not undone) and what
    was wrong with its framing. ``reads`` (read i timed ``times[i]``) is consumed. ``fast=False``: the
    references alone (Python dechunking and joining, the reference stream reader). ``max_parsed``: a
    whole body larger than this is not parsed (``texts.body_accounting``: Config ``max_counted_bytes``,
    past which its text could not be counted anyway); a stream's events are parsed one at a time."""
    framing_error = None
    joined = join_reads(reads, chunked, let_go) if fast and not content_encoding else None
    if joined is not None:
        buf, ends, _ = joined
        response_bytes, inflated = len(buf), True
    else:
        if chunked:
            reads = dechunk_reads(reads)
            if reads.error is not None:
                framing_error = f"malformed chunked framing: {reads.error}"
        response_bytes = sum(map(len, reads))
        reads, inflated = _inflated(reads, content_encoding)
        joined = join_reads(reads, False, let_go) if fast else None
        if joined is None:
            joined = b"".join(reads), list(accumulate(map(len, reads))), True
            reads.clear()
        buf, ends, _ = joined
    del joined
    if not streamed and max_parsed is not None and len(buf) > max_parsed:
        texts = body_accounting(buf, times)
    elif not streamed:
        texts = body_texts(buf, times, api.read_full)
    elif fast:
        texts = api.read_stream(buf, ends, times)
    else:
        texts = api.read_stream_reference(buf, ends, times)
    if not inflated:
        texts.unreadable = f"response body did not decompress ({content_encoding})"
    return texts, response_bytes, framing_error


def _inflated(reads: list[bytes], content_encoding: str) -> tuple[list[bytes], bool]:
    """Undo a Content-Encoding for measuring (the client got the encoded bytes, untouched), letting go of
    each encoded read once it is inflated. Returns the reads (one per read, so times still line up) and
    whether they all decoded."""
    if content_encoding.lower() not in _INFLATED:
        return reads, True
    inflater = zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib header, auto-detected
    out: list[bytes] = []
    try:
        for i, data in enumerate(reads):
            reads[i] = b""
            out.append(inflater.decompress(data))
    except zlib.error:
        out.extend(b"" for _ in range(len(reads) - len(out)))
        return out, False
    return out, True
