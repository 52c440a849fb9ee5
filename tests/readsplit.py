"""Cutting a byte stream into reads at arbitrary points: how the tests of every sans-I/O parser here
(SSE events, chunk framing, the relay's end-of-body tracker, the measuring fast path) feed their input."""

from __future__ import annotations


def split(data: bytes, cuts: list[int], *, empty_reads: bool = False) -> list[bytes]:
    """``data`` cut at each of ``cuts`` (taken modulo ``len(data) + 1``). With ``empty_reads``, a repeated
    point gives an empty read, as a socket read of zero payload bytes would."""
    points = [c % (len(data) + 1) for c in cuts]
    points = sorted(points) if empty_reads else sorted(set(points))
    pieces, last = [], 0
    for p in points:
        pieces.append(data[last:p])
        last = p
    pieces.append(data[last:])
    return pieces
