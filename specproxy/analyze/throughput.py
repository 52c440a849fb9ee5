"""Aggregate throughput: completion tokens over the window the requests span, with a bootstrap interval.

Why apart from ``stats``: it is a figure over a window, not over requests one by one; its interval says
only how much the figure depends on which requests fell in the window (see
``aggregate_throughput_interval``); comparisons of it go through ``aggregate.aggregate_ratio``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from specproxy.analyze.arrays import BOOT_CHUNK, check_level, floats

__all__ = ["Throughput", "aggregate_throughput", "aggregate_throughput_interval"]


def _rows(tokens, starts, ends) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t, s, e = floats(tokens), floats(starts), floats(ends)
    if not t.size == s.size == e.size:
        raise ValueError("tokens, starts and ends must have the same length")
    keep = ~(np.isnan(t) | np.isnan(s) | np.isnan(e))  # an incomplete row is dropped whole
    t, s, e = t[keep], s[keep], e[keep]
    if (e < s).any() or (t < 0).any():
        raise ValueError("a request ends before it starts, or has negative tokens")
    return t, s, e


def aggregate_throughput(tokens, starts, ends) -> float | None:
    """Total completion_tokens / (max(end) - min(start)) over the requests given (docs/metrics.md, "aggregate throughput").

    Rows with any field missing are dropped whole. None when there is no data or no elapsed
    time. Read it at high concurrency; at low concurrency the gaps between requests dominate.
    """
    t, s, e = _rows(tokens, starts, ends)
    if t.size == 0 or e.max() - s.min() <= 0:
        return None
    return float(t.sum() / (e.max() - s.min()))


@dataclass(frozen=True)
class Throughput:
    value: float | None
    ci_low: float | None
    ci_high: float | None
    n: int
    window_s: float | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def aggregate_throughput_interval(tokens, starts, ends, *, n_boot: int = 2000, seed: int = 0,
                                  level: float = 0.95) -> Throughput:
    """Aggregate throughput with a percentile-bootstrap interval over requests.

    Not used by ``compare`` (aggregate.aggregate_ratio is): with the window fixed, only token
    counts vary, so fixed-length outputs give an interval of zero width.

    Limits: the window is held fixed and requests are resampled as if independent, so the
    interval only says how much the figure depends on which requests (how long their outputs)
    fell in the window. It does not include run-to-run or restart-to-restart variance: for that, measure several windows/instances and compare them with
    ``bootstrap_ratio`` over per-window values.
    """
    check_level(level)
    t, s, e = _rows(tokens, starts, ends)
    if t.size == 0 or e.max() - s.min() <= 0:
        return Throughput(None, None, None, int(t.size), None)
    window = float(e.max() - s.min())
    rng = np.random.default_rng(seed)
    n = t.size
    rows = max(1, BOOT_CHUNK // n)
    totals = np.concatenate([t[rng.integers(0, n, (min(rows, n_boot - i), n))].sum(1)
                             for i in range(0, n_boot, rows)])
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(totals / window, [alpha, 1.0 - alpha])
    return Throughput(float(t.sum() / window), float(lo), float(hi), int(n), window)
