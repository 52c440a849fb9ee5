"""When a stream's chunks arrived, as the figures per chunk need it: the first event, and the gaps between
text-carrying chunks, bucketed.

Why here and not in the metrics: the OpenTelemetry GenAI conventions define
``gen_ai.client.operation.time_per_output_chunk`` as one observation per chunk (the time since the
previous one), so a turn of a thousand chunks is a thousand observations. Bucketing them costs a step
per chunk, which belongs in the measuring thread (``RecordBuilder.build``), never on the event loop
where the metrics take a record: the loop adds a turn's bucket counts, a few additions. The gaps are
not stored (a turn's row keeps ``chunks``, ``t_first_token`` and ``t_last_token``); they go to the
metrics beside the record (``StreamTiming``).

A chunk is timed by the read that completed it (as every time of a turn is). Chunks completed by one
read arrived together: the gaps between them are 0, as the client saw them.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

__all__ = ["GAP_BOUNDS_S", "StreamTiming", "gap_buckets"]

# the bucket bounds of the per-chunk time histogram (seconds): fine at the low end, where decoding is
GAP_BOUNDS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                0.75, 1.0, 2.5)


@dataclass(frozen=True, slots=True)
class StreamTiming:
    """What a streamed turn hands the metrics beside its Record (never stored).

    ``first_chunk_s``: request read to the first event of the response body (any event with data: a
    role-only chunk, a Messages ``message_start``, a Responses ``response.created``); None when no event
    came. ``gap_counts``: the gaps between consecutive text-carrying chunks, counted per bucket of
    ``GAP_BOUNDS_S`` (``le``: a gap equal to a bound is in its bucket; the last count is over the last
    bound); ``gap_sum``: their sum, exactly ``t_last_token - t_first_token``."""

    first_chunk_s: float | None
    gap_counts: tuple[int, ...] | None
    gap_sum: float


def gap_buckets(times: list[float], counts: list[int]) -> tuple[tuple[int, ...], float] | None:
    """The gaps of chunks that arrived at ``times`` (increasing), ``counts[i]`` of them at ``times[i]``,
    bucketed: ``(counts per bucket, sum)``; None with fewer than two chunks."""
    total = sum(counts)
    if total < 2:
        return None
    if len(times) > _VECTOR_FROM:  # one pass in numpy rather than a step per gap
        t = np.asarray(times)
        out = np.bincount(np.searchsorted(_BOUNDS, np.diff(t), side="left"), minlength=len(GAP_BOUNDS_S) + 1)
        out[0] += total - len(times)  # the chunks that came with another in one read: gaps of 0
        return tuple(out.tolist()), times[-1] - times[0]
    out = [0] * (len(GAP_BOUNDS_S) + 1)
    out[0] = total - len(times)
    bounds = GAP_BOUNDS_S
    prev = times[0]
    for t in times[1:]:
        out[bisect_left(bounds, t - prev)] += 1  # side left: a gap equal to a bound is in its bucket (le)
        prev = t
    return tuple(out), times[-1] - times[0]


_BOUNDS = np.asarray(GAP_BOUNDS_S)
_VECTOR_FROM = 32  # reads with text; below it the loop costs less than numpy's calls
