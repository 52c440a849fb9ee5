"""``summarize`` finds its median, p95 and the median's interval by partitions, not sorts: held here to
the sort it replaced (the interpolated order-statistic interval read off the sorted values), value for
value, over sizes where the interval's ranks move, ties and NaNs."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings, strategies as st

from specproxy.analyze.summary import _between, _median_ranks, summarize
from tests.budget import examples


def by_sorting(values: np.ndarray, level: float = 0.95):
    """The reference: every figure read off one sorted copy."""
    x = np.sort(values[~np.isnan(values)])
    n = x.size
    ranks = _median_ranks(n, level)
    lo = hi = None
    if ranks is not None:
        d, lam = ranks
        lo, hi = float(_between(x[d - 1], x[d], lam)), float(_between(x[n - d], x[n - d - 1], lam))
    return n, float(np.median(x)), float(np.percentile(x, 95)), lo, hi, float(x.mean())


values = st.lists(st.one_of(st.floats(-1e6, 1e6), st.sampled_from([0.0, 1.0, 2.5, -3.0, math.nan])),
                  min_size=1, max_size=400)


@settings(max_examples=examples(400))
@given(values, st.sampled_from([0.9, 0.95, 0.99]))
def test_the_partitions_give_what_the_sort_gave(xs, level):
    arr = np.array(xs, dtype=float)
    if np.isnan(arr).all():
        return
    n, median, p95, lo, hi, mean = by_sorting(arr, level)
    s = summarize(arr, level=level)
    assert (s.n, s.median, s.p95, s.ci_low, s.ci_high) == (n, median, p95, lo, hi)
    assert math.isclose(s.mean, mean, rel_tol=1e-12, abs_tol=1e-9)


def test_a_large_sample_too():
    rng = np.random.default_rng(3)
    for n in (999_999, 1_000_000):
        arr = rng.lognormal(3.0, 1.0, n)
        arr[rng.random(n) < 0.03] = np.nan
        want = by_sorting(arr)
        s = summarize(arr)
        assert (s.n, s.median, s.p95, s.ci_low, s.ci_high) == want[:5]
