"""The numbers behind the report's pictures (the live page and ``report --html``): distributions, the
operating point, throughput over time and the whole-turn speedup curve.

Why here and not in the page: each is taken over the same turns as the report's figures (completed
turns; the stream figures over streamed ones, ``report.streamed_mask``) and through the same functions
(``report.aggregate_throughput``, ``speedup.window_speedups``), so a picture cannot disagree with the
number printed beside it. The page only draws.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specproxy.analyze.report_data import aggregate_throughput, streamed_mask
from specproxy.analyze.speedup import window_speedups
from specproxy.analyze.summary import summarize
from specproxy.store.dataset import Turns

__all__ = ["SPEEDUP_GRID", "pictures"]

# engine decode speedups the curve is drawn at (x axis)
SPEEDUP_GRID = tuple(round(1.0 + 0.25 * i, 2) for i in range(29))  # 1x to 8x
# (key, column, label): distributions over streamed turns
STREAM_DISTRIBUTIONS = (
    ("ttft_s", "ttft_s", "TTFT (s)"),
    ("decode_tps", "decode_tps", "decode speed, per stream (tok/s)"),
    ("tokens_per_chunk", "tokens_per_chunk", "tokens per chunk"),
)


def histogram(values: np.ndarray, bins: int = 24) -> dict[str, Any]:
    """Counts of the finite values in ``bins`` equal bins from their min to their max."""
    v = values[np.isfinite(values)]
    if not v.size:
        return {"n": 0, "edges": [], "counts": []}
    lo, hi = float(v.min()), float(v.max())
    if hi <= lo:
        hi = lo + (abs(lo) * 0.01 or 1.0)
    counts, edges = np.histogram(v, bins=bins, range=(lo, hi))
    return {"n": int(v.size), "edges": edges.tolist(), "counts": counts.tolist()}


def _concurrency(ok: Turns) -> dict[str, Any]:
    """How many turns started at each number in flight (itself included): the operating point."""
    c = ok.num["concurrency"]
    c = c[np.isfinite(c)].astype(int)
    values, counts = np.unique(c, return_counts=True)
    return {"n": int(c.size), "values": values.tolist(), "counts": counts.tolist()}


def _timeline(ok: Turns, slots: int) -> list[dict[str, Any]]:
    """Per slot of wall time (turns by when they started): per-stream decode speed (median over the
    slot's streamed turns) beside aggregate throughput (all the slot's turns)."""
    if not len(ok):
        return []
    start = ok.num["t_wall"]
    t0, t1 = float(np.min(start)), float(np.max(start))
    width = max((t1 - t0) / slots, 1e-9)
    index = np.minimum(((start - t0) / width).astype(int), slots - 1)
    streamed = streamed_mask(ok)
    rows = []
    for i in np.unique(index):
        cell = ok.select(index == i)
        rows.append({
            "slot": int(i),  # slots with no turn started have no row: a line drawn over rows breaks there
            "t_wall": t0 + (int(i) + 0.5) * width,
            "per_stream_tps": summarize(ok.num["decode_tps"][(index == i) & streamed]).median,
            "aggregate_tps": aggregate_throughput(cell)["tps"],
            "n": len(cell),
        })
    return rows


def pictures(turns: Turns, *, slots: int = 24) -> dict[str, Any]:
    """Everything the pictures draw, for the report's turns (all outcomes; completed ones are used)."""
    ok = turns.select(turns.ok) if len(turns) else turns
    streamed = ok.select(streamed_mask(ok)) if len(ok) else ok
    curve = window_speedups(streamed.num["ttft_s"], streamed.num["decode_s"], speedups=SPEEDUP_GRID)
    return {
        "distributions": {key: histogram(streamed.num[col]) for key, col, _ in STREAM_DISTRIBUTIONS},
        "concurrency": _concurrency(ok),
        "timeline": _timeline(ok, slots),
        "speedup_curve": {"n": curve.n, "max_speedup": curve.max_speedup,
                          "points": [(s, v) for s, v in curve.speedups.items()]},
    }
