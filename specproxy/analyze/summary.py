"""Summaries of one figure: n, median, mean, p95, and the 95% interval of the median.

Why: on inference hardware one config varies a lot from run to run (docs/statistics.md), so a bare
median is a confident number that may be wrong; here every figure has n and an interval. The
comparisons of two arms are in ``stats`` (the A/B ratio), which this module knows nothing of.

* CI of a median (``summarize``): the distribution-free order-statistic interval, interpolated
  between neighbouring order statistics (Hettmansperger & Sheather 1986). No distributional
  assumption (latencies are skewed), no random numbers, a few order statistics: O(n). Uninterpolated,
  the coverage jumps with n; interpolated it is close to the level at every n. Below 6 values
  no pair of order statistics covers 95%: the interval is then None, not a made-up one.
* A figure of few replicates (``mean_ci``): Student's t interval of their mean.
* Values in clusters (server instances, a benchmark's rounds; ``summarize_clustered``): the interval
  of the median over whole clusters, by the rule ``stats.bootstrap_ratio`` uses for an arm in
  several instances.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from specproxy.analyze.arrays import check_level, clean, clean_labelled, finite
from specproxy.analyze.order_stats import order_statistics, quantile_at, quantile_from
from specproxy.analyze.resample import boot_instances, log_var
from specproxy.analyze.tdist import t_ppf

__all__ = ["Summary", "mean_ci", "median", "median_ci", "median_p95_max", "summarize", "summarize_clustered",
           "summarize_finite"]


@dataclass(frozen=True)
class Summary:
    """n, median, mean, p95 and the 95% CI of the median. With n = 0 every figure is None."""
    n: int
    median: float | None
    mean: float | None
    p95: float | None
    ci_low: float | None
    ci_high: float | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def median_ci(values, level: float = 0.95) -> tuple[float | None, float | None]:
    """Interpolated order-statistic CI of the median; (None, None) when n < 6 (at 95%).

    gamma_d = P(d <= B <= n-d), B ~ Bin(n, 1/2), is the exact coverage of [X(d), X(n-d+1)] for any
    continuous distribution. Take the largest d with gamma_d >= level and move each end towards
    the next order statistic by lambda = (n-d)I / (d + (n-2d)I), I = (gamma_d - level) /
    (gamma_d - gamma_{d+1}) (Hettmansperger & Sheather 1986). Four order statistics
    (``order_stats``), O(n), not a sort.
    """
    check_level(level)
    return _median_ci(clean(values), level)


# exp of a log pmf below this is 0.0 to the last bit (the least double is exp(-745.1)): the cdf's terms
# before the first one above it add nothing, so they are neither computed nor added
_EXP_ZERO = -800.0


@functools.lru_cache(maxsize=512)
def _median_ranks(n: int, level: float) -> tuple[int, float] | None:
    """(d, lambda) of ``median_ci`` at size n (None: no interval): the same for every figure of that size,
    and O(n) to find, so found once.

    P(B <= j), B ~ Bin(n, 1/2), from the log pmf (no underflow): the log pmf is a running sum from j = 0,
    and the cdf a running sum of its exp. Only what is read is computed: the log pmf up to j = n//2 - 1
    (the last cdf term a gamma reads), and exp and the cdf's sum only from the first term that is not 0.0
    (the left tail of a large n underflows: adding 0.0 changes no bit). Every term that is computed is the
    same operation on the same operands as over the whole range, so (d, lambda) are the same to the last
    bit (``tests/unit/test_median_ranks.py`` holds this to the whole-range computation)."""
    if n < 2:
        return None
    m = n // 2  # gamma_d for d = 1..m reads cdf[0..m - 1]
    # (n - j) / (j + 1) for j = 0..m - 2: both ends whole numbers, exact as floats (as n - j and j + 1.0 of a
    # float j are), each made by one arange into the buffer it is read from
    ratio = np.arange(n, n - m + 1, -1, dtype=float)
    ratio /= np.arange(1.0, m, dtype=float)
    log_pmf = np.empty(m)
    log_pmf[0] = 0.0
    np.cumsum(np.log(ratio, out=ratio), out=log_pmf[1:])
    log_pmf += n * math.log(0.5)
    first = int(np.searchsorted(log_pmf, _EXP_ZERO))  # non-decreasing: every term below j = m is >= 1
    cdf = np.cumsum(np.exp(log_pmf[first:]))  # cdf[first:]; the cdf is 0.0 before
    gamma = 1.0 - 2.0 * cdf  # gamma_d for d = first + 1..m; 1.0 before (> level)
    ok = np.nonzero(gamma >= level)[0]
    if ok.size:
        last = first + int(ok[-1])
    elif first:
        last = first - 1
    else:
        return None
    d_best = last + 1

    def gamma_at(i: int) -> float:
        return float(gamma[i - first]) if i >= first else 1.0

    g_d = gamma_at(last)
    g_next = gamma_at(d_best) if d_best < m else 0.0
    i = (g_d - level) / (g_d - g_next) if g_d > g_next else 0.0
    lam = (n - d_best) * i / (d_best + (n - 2 * d_best) * i) if i > 0 else 0.0
    return d_best, lam


def _median_ci(x: np.ndarray, level: float) -> tuple[float | None, float | None]:
    """``median_ci`` of clean values, in any order."""
    ranks = _median_ranks(x.size, level)
    if ranks is None:
        return None, None
    return _ci_ends(order_statistics(x, _ci_at(x.size, ranks)), x.size, ranks)


def _ci_at(n: int, ranks: tuple[int, float]) -> list[int]:
    d = ranks[0]
    return [d - 1, d, n - d - 1, n - d]


def _ci_ends(part: Mapping[int, Any], n: int, ranks: tuple[int, float]) -> tuple[float, float]:
    """The interval's ends from the order statistics at ``_ci_at``'s ranks (``part[k]``: the k-th smallest)."""
    d, lam = ranks
    return float(_between(part[d - 1], part[d], lam)), float(_between(part[n - d], part[n - d - 1], lam))


def _median(part: Mapping[int, Any], n: int) -> float:
    """``numpy.median`` read off the order statistics at ``(n - 1) // 2`` and ``n // 2``."""
    if n % 2:
        return float(part[n // 2])
    return float(np.mean(np.array([part[n // 2 - 1], part[n // 2]])))


def _between(a: float, b: float, lam: float) -> float:
    """``a`` moved towards ``b`` by ``lam``, never outside [a, b] (rounding could step past b,
    and an interval end past the median it brackets is a wrong answer, however small)."""
    v = (1 - lam) * a + lam * b
    return min(max(v, min(a, b)), max(a, b))


def summarize(values: Iterable[Any] | None, *, seed: int = 0, level: float = 0.95) -> Summary:
    """Summary of one metric. None/NaN are dropped (missing is missing, never 0).

    ``seed`` is accepted for API stability and unused: the order-statistic interval is exact
    and deterministic. p95 is numpy's linear-interpolation percentile (descriptive only; at
    small n it is close to the maximum). O(n): the median, p95 and the interval's ends are order
    statistics (``order_stats``), never a sort (the mean is summed in the values' order).
    """
    return summarize_finite(finite(values), level=level)  # read only: order statistics in place, summed where it is


def summarize_finite(x: np.ndarray, *, level: float = 0.95) -> Summary:
    """``summarize`` of float64 values already known to be numbers (none missing, none infinite: what
    ``arrays.finite`` or ``by_cell.finite_by_cell`` returns), without looking at each again."""
    check_level(level)
    if x.size == 0:
        return Summary(0, None, None, None, None, None)
    n = x.size
    ranks = _median_ranks(n, level)
    at = {(n - 1) // 2, n // 2, *quantile_at(n, 0.95), *(_ci_at(n, ranks) if ranks is not None else ())}
    part = order_statistics(x, at)  # every order statistic below at once
    lo, hi = _ci_ends(part, n, ranks) if ranks is not None else (None, None)
    return Summary(int(n), _median(part, n), float(x.mean()), quantile_from(part, n, 0.95), lo, hi)


def median(x: np.ndarray) -> float:
    """``numpy.median`` of clean float64 values (at least one), to the last bit, from the two middle order
    statistics: no partitioned copy of a month's column."""
    n = x.size
    return _median(order_statistics(x, {(n - 1) // 2, n // 2}), n)


def median_p95_max(x: np.ndarray) -> tuple[float, float, float]:
    """``numpy.median``, ``numpy.percentile(x, 95)`` and the max of clean values (at least one), to the last
    bit, read off one set of order statistics: numpy partitions once for each, and the max is one more pass."""
    n = x.size
    part = order_statistics(x, {(n - 1) // 2, n // 2, *quantile_at(n, 0.95), n - 1})
    return _median(part, n), quantile_from(part, n, 0.95), float(part[n - 1])


def mean_ci(values, level: float = 0.95) -> tuple[float | None, float | None, float | None]:
    """(mean, low, high): Student's t interval of the mean; the ends are None below 2 values.

    For a few replicates of one figure (a benchmark's aggregate throughput per repeat or per server
    instance), where a median's order-statistic interval needs 6 values and the replicates are
    themselves averages over many turns, so their mean is close to normal."""
    check_level(level)
    x = clean(values)
    if x.size == 0:
        return None, None, None
    mean = float(x.mean())
    if x.size < 2:
        return mean, None, None
    half = t_ppf(0.5 + level / 2, x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return mean, mean - half, mean + half


def summarize_clustered(values: Iterable[Any], clusters: Sequence[Any], *, seed: int = 0,
                        level: float = 0.95) -> Summary:
    """``summarize``, but the interval of the median is over clusters (server instances, or a benchmark's
    rounds), not over values: values of one cluster share its offset (an instance's from its start, a
    round's from drift within an instance), so pooling them as independent gives an interval that leaves
    out the cluster-to-cluster variance. Which variance that is depends on the clusters: instances carry
    restart-to-restart variation, rounds of one instance only run-to-run drift.

    compare's rule for an arm in several instances (``bootstrap_ratio``): the variance of the log pooled
    median when whole clusters are resampled, times k/(k-1), and Student t with k - 1 df; the interval is
    the median times exp(+-t * se). Below 2 clusters, or with a 0 among the bootstrap medians, no interval."""
    check_level(level)
    x, lab, uniq = clean_labelled(values, clusters)
    base = summarize(x, level=level)
    k = len(uniq)
    if x.size == 0 or k < 2 or base.median is None or base.median <= 0 or (x < 0).any():
        return dataclasses.replace(base, ci_low=None, ci_high=None)
    v = float(log_var(boot_instances(x, lab, "median", 2000, np.random.default_rng(seed)))[0]) * k / (k - 1)
    if not math.isfinite(v):
        return dataclasses.replace(base, ci_low=None, ci_high=None)
    half = t_ppf(0.5 + level / 2, k - 1) * math.sqrt(v)
    return dataclasses.replace(base, ci_low=base.median * math.exp(-half), ci_high=base.median * math.exp(half))

