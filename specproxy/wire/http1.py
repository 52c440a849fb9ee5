"""HTTP/1.1 from the upstream, sans I/O: where a response body ends (RFC 9112 6.3); its head is
``response_head.py``'s.

Why apart from ``upstream.py``: these are pure functions and small state machines over bytes (no
sockets, no loop), each tested against every split of its input. A chunked body's end is found by the
one chunked-framing parser (``frames/chunked.py``'s ``ChunkedEnd``, or ``_chunked.h`` natively), not
here. ``upstream.py`` owns the connections that feed them.
"""

from __future__ import annotations

__all__ = ["LengthEnd", "UntilClose"]


class LengthEnd:
    """A Content-Length body: ends after ``rem`` more bytes."""

    __slots__ = ("payload", "rem")

    def __init__(self, length: int) -> None:
        self.rem = length
        self.payload = None

    def feed(self, data: bytes) -> int:
        self.rem -= len(data)
        return -1 if self.rem > 0 else len(data) + self.rem


class UntilClose:
    __slots__ = ("payload",)

    def __init__(self) -> None:
        self.payload = None

    def feed(self, data: bytes) -> int:
        return -1
