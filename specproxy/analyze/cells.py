"""Which cell of a report a turn belongs to (concurrency and prompt-size buckets), and which figure to
read at an operating point: per-stream or aggregate.

Why one module: the report, the comparison and the docs must bucket the same way.
"""

from __future__ import annotations

import numpy as np

from specproxy.analyze.arrays import missing
from specproxy.analyze.by_cell import buckets

__all__ = ["CONCURRENCY_BUCKETS", "PER_STREAM_MAX_CONCURRENCY", "PROMPT_BUCKETS", "bucket_side", "concurrency_bucket",
           "concurrency_buckets", "groups", "prompt_bucket", "prompt_buckets", "which_to_read"]


CONCURRENCY_BUCKETS = ("1", "2", "3-4", "5-8", "9-16", "17-32", "33-64", "65+")
_CONC_EDGES = (1, 2, 4, 8, 16, 32, 64)
PROMPT_BUCKETS = ("<1k", "1k-4k", "4k-16k", "16k-64k", "64k+")
_PROMPT_EDGES = (1024, 4096, 16384, 65536)  # 1k = 1024 tokens, as context sizes are quoted
PER_STREAM_MAX_CONCURRENCY = 4


def concurrency_bucket(c: float | None) -> str | None:
    """Bucket label for ``concurrency`` (requests in flight, this one included, so >= 1).

    Powers of two, as concurrency is swept. A non-integer (a median) goes to the bucket whose
    range contains it when rounded up: 2.5 -> "3-4". None -> None.
    """
    if missing(c):
        return None
    if c < 1:
        raise ValueError(f"concurrency counts the request itself, so it is >= 1; got {c}")
    for label, edge in zip(CONCURRENCY_BUCKETS, _CONC_EDGES):
        if c <= edge:
            return label
    return CONCURRENCY_BUCKETS[-1]


def prompt_bucket(tokens: float | None) -> str | None:
    """Bucket label for ``prompt_tokens``: <1k, 1k-4k, 4k-16k, 16k-64k, 64k+ (1k = 1024)."""
    if missing(tokens):
        return None
    if tokens < 0:
        raise ValueError(f"prompt tokens must be >= 0, got {tokens}")
    for label, edge in zip(PROMPT_BUCKETS, _PROMPT_EDGES):
        if tokens < edge:
            return label
    return PROMPT_BUCKETS[-1]


def concurrency_buckets(c: np.ndarray, positions: np.ndarray | None = None) -> np.ndarray:
    """``concurrency_bucket`` for a whole column at once (at ``positions`` when given): indexes into
    CONCURRENCY_BUCKETS (-1 where the value is missing), int8. Reports over a million turns cannot afford a
    Python loop (``by_cell.buckets``)."""
    return buckets(c, positions, _CONC_EDGES, inclusive=False)


def prompt_buckets(tokens: np.ndarray, positions: np.ndarray | None = None) -> np.ndarray:
    """``prompt_bucket`` for a whole column (at ``positions`` when given): indexes into PROMPT_BUCKETS (-1 where
    missing), int8."""
    return buckets(tokens, positions, _PROMPT_EDGES, inclusive=True)


def groups(index: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """Each cell of a table and its rows: ``(cell, positions)`` for every cell ``>= 0`` in ``index``, cells
    ascending, each cell's positions ascending (their order in ``index``, as a mask selects them).

    From one stable sort of the cell numbers, narrowed to the fewest bits that hold them (8 or 16: numpy
    sorts those by radix, two passes), each cell's positions a slice of its result: a pass per cell (a
    comparison and a selection each) cost 0.1 s a cell at 10M turns."""
    index = np.asarray(index)
    if not len(index):
        return []
    top = int(index.max())
    if top < 0:
        return []
    narrow = np.int8 if top < 2**7 else np.int16 if top < 2**15 else np.int64
    cells = index.astype(narrow, copy=False)
    order = np.argsort(cells, kind="stable")
    bounds = np.searchsorted(cells[order], np.arange(top + 2, dtype=narrow if top + 1 < np.iinfo(narrow).max else np.int64))
    return [(b, order[bounds[b]:bounds[b + 1]]) for b in range(top + 1) if bounds[b + 1] > bounds[b]]


def bucket_side(bucket: int) -> str:
    """``which_to_read`` of any median of values in concurrency cell ``bucket`` (an index into
    CONCURRENCY_BUCKETS). The threshold is one of the cells' edges, so each cell lies on one side of it,
    and a median of values in ``(low, high]`` lies in it too (the mean of two of them, rounded, as well):
    a cell's answer needs none of its values (``tests/unit/test_stats.py`` holds it to the medians)."""
    high = _CONC_EDGES[bucket] if bucket < len(_CONC_EDGES) else np.inf
    if high <= PER_STREAM_MAX_CONCURRENCY:
        return "per-stream"
    return "aggregate"


def which_to_read(concurrency_median: float | None) -> str | None:
    """"per-stream" when the median concurrency is <= 4, else "aggregate"; None without data.

    Threshold 4: a single user's chat client plus an agent or two sits at 1-4; there the wall
    clock of an aggregate figure is mostly gaps between requests (a change that read 0.91x in
    aggregate was 1.42x per stream, in one measured case), and what a user feels is per-stream
    speed. Above it the card is shared and total output matters. Use the median of
    ``concurrency``, never a configured max.
    """
    if missing(concurrency_median):
        return None
    return "per-stream" if concurrency_median <= PER_STREAM_MAX_CONCURRENCY else "aggregate"
