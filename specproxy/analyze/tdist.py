"""Student's t quantiles without scipy: the exact CDF through the incomplete beta function, and a grid
in 1/df so that a batch of comparisons gets the same numbers as one comparison.
"""

from __future__ import annotations

import functools
import math
from statistics import NormalDist

import numpy as np

__all__ = ["betainc", "t_ppf", "t_quantiles"]

_T_GRID_MIN_DF = 4.0  # t quantiles for df below this are computed exactly


def betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b) by its continued fraction (modified Lentz)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return front * h


def t_ppf(p: float, df: float) -> float:
    """Quantile of Student's t for p > 1/2 (bisection on the exact CDF); normal when df = inf."""
    if not math.isfinite(df) or df > 1e7:
        return NormalDist().inv_cdf(p)
    tail = 1.0 - p
    sf = lambda t: 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))  # noqa: E731
    lo, hi = 0.0, 2.0
    while sf(hi) > tail:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if sf(mid) > tail else (lo, mid)
        if hi - lo < 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


_INV_DF = np.linspace(0.0, 1.0 / _T_GRID_MIN_DF, 401)  # the grid in 1/df


@functools.lru_cache(maxsize=8)
def _t_grid(p: float) -> np.ndarray:
    """``t_ppf(p, 1 / x)`` at each grid point x, NaN until ``_grid_for`` fills it: a point costs ~40 exact
    CDFs (about 8 ms), the whole grid over 3 s, and a call reads two points per df."""
    return np.full(_INV_DF.size, np.nan)


def _grid_for(p: float, x: np.ndarray) -> np.ndarray:
    """The grid of ``p`` with the points ``np.interp`` reads at ``x`` (each x's bracketing pair) filled."""
    q = _t_grid(p)
    below = np.searchsorted(_INV_DF, x[~np.isnan(x)], side="right") - 1
    need = np.unique(np.clip(np.concatenate([below, below + 1]), 0, _INV_DF.size - 1))
    for i in need[np.isnan(q[need])].tolist():
        q[i] = t_ppf(p, 1.0 / _INV_DF[i] if _INV_DF[i] > 0 else math.inf)
    return q


def t_quantiles(p: float, df: np.ndarray) -> np.ndarray:
    """``t_ppf`` for an array of df: interpolated in 1/df (smooth there; error < 1e-5) for
    df >= _T_GRID_MIN_DF, exact below. One function for the batch and the single comparison,
    so both give the same numbers."""
    df = np.asarray(df, dtype=float)
    with np.errstate(divide="ignore"):
        x = 1.0 / df
    out = np.interp(x, _INV_DF, _grid_for(p, np.atleast_1d(x)))
    small = df < _T_GRID_MIN_DF
    if small.any():
        out[small] = [t_ppf(p, d) for d in df[small]]
    return out
