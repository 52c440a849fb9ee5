"""Bootstrap replicates for the ratio rows: over requests (plain, or smoothed for the median) and over
whole server instances. Replicates only: the intervals and verdicts made from them are in ``stats``.

Why apart: these are the costly loops, each kept O(n_boot) or O(n_boot * k * log n) per arm however
many turns an arm has (compare runs on arms of thousands of turns), and never materialising a resample
of requests.
"""

from __future__ import annotations

import math

import numpy as np

from specproxy.analyze.arrays import BOOT_CHUNK, stable_argsort, take_last
from specproxy.analyze.order_stats import order_statistics

__all__ = ["STATS", "boot_instance_ratio", "boot_instances", "boot_requests", "finite_var", "log_var",
           "smoothed_log_medians"]

STATS = {"median": 0.5, "p95": 0.95, "mean": None}  # quantiles are numpy's default (linear)


def _order_statistics(n: int, q: float, n_boot: int, rng
                       ) -> tuple[np.ndarray, np.ndarray | None, float]:
    """Where a resample of n values puts the order statistics behind its ``q`` quantile (numpy's
    linear definition): U_(r) ~ Beta(r, n-r+1) of n uniforms, and, when the quantile falls between
    two, the next one U_(r) + (1-U_(r)) * Beta(1, n-r) with the weight of the upper one.
    Returns (u, u_next or None, weight), each of shape (1, n_boot). O(n_boot) however large n is.

    One draw serves a whole batch of arms of one size: a row's replicates are then exactly those of
    a call with that row alone and the same seed (what compare computes), and a calibration over a
    thousand arms costs one draw, not a thousand."""
    h = (n - 1) * q
    r = int(math.floor(h)) + 1  # 1-based rank of the lower order statistic
    frac = h - (r - 1)
    u = rng.beta(r, n - r + 1, (1, n_boot))
    if frac > 0 and r < n:
        return u, u + (1.0 - u) * rng.beta(1, n - r, (1, n_boot)), frac
    return u, None, 0.0


def boot_requests(x_sorted: np.ndarray, stat: str, n_boot: int, rng) -> np.ndarray:
    """Bootstrap replicates of stat over requests, for a batch of arms of equal size.

    ``x_sorted``: (arms, n), each row sorted. Returns (arms, n_boot). For a quantile: a
    resample is x_sorted[I_1..I_n] with I uniform, so its r-th order statistic is
    x_sorted[floor(n * U_(r))] (``_order_statistics``). Exact, and O(n_boot) per arm.
    """
    n = x_sorted.shape[1]
    q = STATS[stat]
    if q is None:
        rows = max(1, BOOT_CHUNK // n)
        return np.stack([np.concatenate([x[rng.integers(0, n, (min(rows, n_boot - s), n))].mean(1)
                                         for s in range(0, n_boot, rows)]) for x in x_sorted])
    u, u_next, frac = _order_statistics(n, q, n_boot, rng)  # one draw for the batch
    pick = lambda v: take_last(x_sorted, np.minimum((v * n).astype(np.int64), n - 1))  # noqa: E731
    out = pick(u)
    return out if u_next is None else out + frac * (pick(u_next) - out)


def smoothed_log_medians(x_sorted: np.ndarray, n_boot: int, rng) -> np.ndarray:
    """Replicates of log(median) over requests from the smoothed bootstrap, for a batch of arms.

    A resample is drawn from the continuous distribution whose quantile function interpolates
    the sorted log values linearly, the i-th (0-based) sitting at probability (i + 1/2) / n; its
    median is that function at the resample's middle uniform order statistics. A median of a few
    values can only be one of them, and a plain bootstrap's replicates take those few values;
    smoothing lets the replicates fall between them (docs/statistics.md, "Medians").
    Returns (arms, n_boot); -inf or NaN where the arm's values near the median include 0."""
    n = x_sorted.shape[1]
    with np.errstate(divide="ignore"):
        y = np.log(x_sorted)

    def at(u: np.ndarray) -> np.ndarray:
        pos = np.clip(n * u - 0.5, 0.0, n - 1.0)
        i = np.minimum(pos.astype(np.int64), max(n - 2, 0))
        lo, hi = take_last(y, i), take_last(y, np.minimum(i + 1, n - 1))
        with np.errstate(invalid="ignore"):
            return lo + (pos - i) * (hi - lo)

    u, u_next, frac = _order_statistics(n, 0.5, n_boot, rng)  # one draw for the batch
    out = at(u)
    return out if u_next is None else out + frac * (at(u_next) - out)


def boot_instances(x: np.ndarray, lab: np.ndarray, stat: str, n_boot: int, rng) -> np.ndarray:
    """Replicates of the pooled stat when whole instances are resampled with replacement."""
    q = STATS[stat]
    if q is None:
        return boot_instance_ratio(x, np.ones_like(x), lab, n_boot, rng)
    k = int(lab.max()) + 1
    counts = rng.multinomial(k, np.full(k, 1.0 / k), size=n_boot)  # copies of each instance
    sizes = np.bincount(lab, minlength=k)
    total = counts @ sizes
    h = (total - 1) * q
    r = np.floor(h).astype(np.int64)
    r_next = np.minimum(r + 1, total - 1)
    at_rank = _pooled(*_band(x, lab, k, q, sizes, counts, r, r_next), k, counts)
    v1 = at_rank(r)
    return v1 + (h - r) * (at_rank(r_next) - v1)


_BAND_MARGIN = 16  # order statistics either side of each instance's quantile that the band holds, beyond
_SAMPLE = 65536  # about how many values the band's bounds are estimated from (every s-th value)


def _band(x: np.ndarray, lab: np.ndarray, k: int, q: float, sizes: np.ndarray, counts: np.ndarray,
          r: np.ndarray, r_next: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The values every replicate's pooled order statistics at ranks ``r`` and ``r_next`` lie among, with
    their instances and how many of each instance's values lie below them.

    Why: a quantile of a mix of instances lies between the instances' own quantiles, so the pooled
    ranks need only the values from the lowest instance's quantile to the highest one's (a few percent
    of a month's turns), not a sort of all of them. The instances' quantiles are estimated from every
    s-th value (about ``_SAMPLE``), widened by four standard errors of a sample quantile's rank and
    ``_BAND_MARGIN``; the band is then checked against every replicate (the pooled count below it at
    most the rank, below its top above the next rank). Where the check fails, or the band would be most
    of the values, it is all the values: the replicates never depend on the estimate, only the time."""
    everything = (x, lab, np.zeros(k, dtype=np.int64))
    if k > 64 or x.size < 4 * k * (2 * _BAND_MARGIN + 2):
        return everything
    step = max(1, x.size // _SAMPLE)
    xs, ls = x[::step], lab[::step]
    grouped = xs[np.argsort(ls, kind="stable")]
    ends = np.cumsum(np.bincount(ls, minlength=k))
    lows, highs = [], []
    for j in range(k):
        n_j = int(ends[j] - (ends[j - 1] if j else 0))
        if not n_j:
            continue
        at, wide = int((n_j - 1) * q), _BAND_MARGIN + (0 if step == 1 else int(4 * math.sqrt(n_j)))
        lo, hi = max(0, at - wide), min(n_j - 1, at + 1 + wide)
        got = order_statistics(grouped[ends[j] - n_j:ends[j]], (lo, hi))
        lows.append(got[lo])
        highs.append(got[hi])
    low, high = min(lows), max(highs)
    where = (x >= low).view(np.int8) + (x > high).view(np.int8)  # 0 below the band, 1 in it, 2 above
    per = np.bincount(lab * 3 + where, minlength=3 * k).reshape(k, 3)
    below, band = per[:, 0], per[:, 1]
    if 2 * int(band.sum()) > x.size or not ((counts @ below <= r).all() and (counts @ (below + band) > r_next).all()):
        return everything
    inside = where == 1
    return x[inside], lab[inside], below


def _pooled(x: np.ndarray, lab: np.ndarray, below: np.ndarray, k: int, counts: np.ndarray):
    """``at_rank(rank)``: each replicate's pooled order statistic at ``rank``, from values ``x`` (instances
    ``lab``) above which ``below[j]`` of instance j's lie, by bisection on their sorted order. The pooled
    rank of the first i sorted values is sum_j copies_j * (values of instance j among them, and below),
    found with one searchsorted over (instance, position) keys. O(n_boot * k * log n), memory O(n).
    Equal values give one value whichever of them sorts first."""
    n, n_boot = x.size, counts.shape[0]
    order = stable_argsort(x)
    xs, lab_sorted = x[order], lab[order]
    # positions grouped by instance, increasing (a stable sort of small codes is a radix sort)
    by_inst = np.argsort(lab_sorted.astype(np.int16) if k <= np.iinfo(np.int16).max else lab_sorted, kind="stable")
    keys = lab_sorted[by_inst] * (n + 1) + by_inst
    first = np.searchsorted(keys, np.arange(k) * (n + 1))
    base = counts @ below

    def at_rank(rank: np.ndarray) -> np.ndarray:  # smallest i with pooled count of xs[:i] > rank
        lo, hi = np.ones(n_boot, np.int64), np.full(n_boot, n, np.int64)
        while (lo < hi).any():
            mid = (lo + hi) // 2
            inside = np.searchsorted(keys, np.arange(k) * (n + 1) + mid[:, None]) - first
            above = base + (inside * counts).sum(1) > rank
            lo, hi = np.where(above, lo, mid + 1), np.where(above, mid, hi)
        return xs[lo - 1]

    return at_rank


def boot_instance_ratio(num: np.ndarray, den: np.ndarray, lab: np.ndarray, n_boot: int,
                         rng) -> np.ndarray:
    """Replicates of sum(num) / sum(den) when whole instances are resampled with replacement
    (a mean is num = values, den = 1; aggregate throughput is tokens over busy shares)."""
    k = int(lab.max()) + 1
    counts = rng.multinomial(k, np.full(k, 1.0 / k), size=n_boot)  # copies of each instance
    with np.errstate(divide="ignore", invalid="ignore"):
        return (counts @ np.bincount(lab, weights=num, minlength=k)) / (
            counts @ np.bincount(lab, weights=den, minlength=k))


def log_var(reps: np.ndarray) -> np.ndarray:
    """Variance of log(replicates) per row; NaN where a replicate is 0 (no log scale there)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return finite_var(np.log(np.atleast_2d(reps)))


def finite_var(y: np.ndarray) -> np.ndarray:
    """Variance per row of replicates already on the log scale; NaN where one is not finite."""
    with np.errstate(invalid="ignore"):
        v = np.var(y, axis=1, ddof=1)
    return np.where(np.isfinite(y).all(axis=1), v, np.nan)
