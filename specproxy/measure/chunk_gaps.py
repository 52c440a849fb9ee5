"""When a stream's chunks arrived, as the figures per chunk need it: the first chunk, and the gaps
between consecutive chunks, bucketed.

A chunk, for both of the OpenTelemetry GenAI conventions' per-chunk metrics, is what the client
receives in the response stream: an event with data, whatever it carries (a role-only chunk, text,
a finish or usage chunk, a Messages or Responses event, ``[DONE]`` too, which the client reads like
any other). ``gen_ai.client.operation.time_to_first_chunk`` is the request to the first of them;
``gen_ai.client.operation.time_per_output_chunk`` one observation per chunk after the first, the time
from the previous chunk to it. So the wait from the first event to the first text, and from the last
text to the finish, usage and ``[DONE]`` events, are observed too; specproxy's per-token figures
(``specproxy_time_to_first_token_seconds``, decode time) are the ones about text.

Why here and not in the metrics: a turn of a thousand chunks is a thousand observations. Bucketing
them costs a step per chunk, which belongs in the measuring thread (``build_record``), never on
the event loop where the metrics take a record: the loop adds a turn's bucket counts, a few additions.
The gaps are not stored (a turn's row keeps ``chunks``, ``t_first_token`` and ``t_last_token``); they
go to the metrics beside the record (``StreamTiming``).

A chunk is timed by the read that completed it (as every time of a turn is). Chunks completed by one
read arrived together: the gaps between them are 0, as the client saw them.

``GAP_BOUNDS_S``: the conventions advise the same explicit bucket boundaries for both metrics (0.01 s
doubling to 81.92 s); these are a superset of them, with finer bounds below 0.08 s, where the gaps of
a decoding server lie (a few ms to a few tens of ms) and the advised ones would put nearly all of them
in two buckets. Every advised bound is here, so summing buckets gives the advised histogram exactly.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

__all__ = ["ADVISED_BOUNDS_S", "GAP_BOUNDS_S", "StreamTiming", "gap_buckets"]

# the conventions' advised bounds (ADVISED_BOUNDS_S) with finer ones added below 0.08 s (see above)
ADVISED_BOUNDS_S = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
GAP_BOUNDS_S = tuple(sorted({*ADVISED_BOUNDS_S, 0.001, 0.0025, 0.005, 0.0075, 0.015, 0.03, 0.06}))


@dataclass(frozen=True, slots=True)
class StreamTiming:
    """What a streamed turn hands the metrics beside its Record (never stored).

    ``first_chunk_s``: request read to the first chunk of the response body (any event with data: a
    role-only chunk, a Messages ``message_start``, a Responses ``response.created``); None when no event
    came. ``gap_counts``: the gaps between consecutive chunks (events with data, ``[DONE]`` too),
    counted per bucket of ``GAP_BOUNDS_S`` (``le``: a gap equal to a bound is in its bucket; the last
    count is over the last bound), None with fewer than two chunks; ``gap_sum``: their sum, exactly
    the last chunk's time less the first's."""

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
_VECTOR_FROM = 32  # reads that completed chunks; below it the loop costs less than numpy's calls
