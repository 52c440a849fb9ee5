"""The k-th smallest values of a column: what a summary's median, p95 and interval are read from.

Why a module: every summary of a report reads four to eight order statistics of a column of up to a
month's ten million values, and numpy's ``partition`` (a copy of the column, then a selection around
each rank in turn) was most of a report's time. The C path (``_orderc.c``, radix selection: the column
read a few times in place, nothing moved but the few values that share a rank's leading bits) gives the
same values; ``order_statistics_reference`` is the plain path it is held to (``tests/unit/test_orderc.py``)
and the one that runs when the extension was not built.

Equal values are equal: where +0.0 and -0.0 both sit at a rank, either may be returned (numpy's
partition does not say which either).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

try:
    from specproxy.analyze import _orderc
except ImportError:  # no compiler at install: numpy's partition reads every order statistic
    _orderc = None

__all__ = ["NATIVE", "order_statistics", "order_statistics_reference", "quantile", "quantile_at", "quantile_from"]

NATIVE = _orderc is not None
# below this many values numpy's partition is as quick (the C path's fixed cost is a 256 KB count table)
_NATIVE_MIN = 4096
_MAX_RANKS = 16


def order_statistics(x: np.ndarray, ranks: Sequence[int]) -> dict[int, np.float64]:
    """``{k: the k-th smallest of x}`` (0-based) for each k in ``ranks``; ``x``: finite float64 values, left
    as they are."""
    at = sorted(set(ranks))
    if _orderc is None or x.size < _NATIVE_MIN or len(at) > _MAX_RANKS or x.dtype != np.float64:
        return order_statistics_reference(x, at)
    got = _orderc.select(np.ascontiguousarray(x), tuple(at))
    return {k: np.float64(v) for k, v in zip(at, got)}


def order_statistics_reference(x: np.ndarray, ranks: Sequence[int]) -> dict[int, np.float64]:
    """``order_statistics`` by one ``numpy.partition`` (of a copy)."""
    at = sorted(set(ranks))
    part = np.partition(x, at)
    return {k: part[k] for k in at}


def quantile_at(n: int, q: float) -> tuple[int, int]:
    """The two ranks ``numpy.quantile`` (its linear default) interpolates between over n values."""
    virtual = (n - 1) * np.float64(q)
    if virtual >= n - 1:
        return n - 1, n - 1
    i = int(np.floor(virtual))
    return i, i + 1


def quantile_from(part: Mapping[int, Any], n: int, q: float) -> float:
    """``numpy.quantile(x, q)`` read off x's order statistics at ``quantile_at(n, q)`` (``part[k]``: the k-th
    smallest): numpy's virtual index, neighbours (the last value past the end, with its index -1 in the
    weight) and interpolation (its ``_lerp``), step for step, so the figure is the same to the last bit."""
    virtual = (n - 1) * np.float64(q)
    i, j = quantile_at(n, q)
    below = -1 if virtual >= n - 1 else i
    a, b = part[i], part[j]
    t = virtual - below
    diff = b - a
    return float(b - diff * (1 - t)) if t >= 0.5 else float(a + diff * t)


def quantile(x: np.ndarray, q: float) -> float:
    """``numpy.quantile(x, q)`` of finite float64 values (at least one), from two order statistics where
    numpy partitions a copy of the column."""
    return quantile_from(order_statistics(x, quantile_at(x.size, q)), x.size, q)
