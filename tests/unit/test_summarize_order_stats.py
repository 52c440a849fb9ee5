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


def test_median_is_numpys_of_the_ints_to_the_bit():
    """``median`` (the audit's, of counts held as float64) against ``numpy.median`` of the same counts as
    Python ints, as the audit's per-turn lists held them: odd and even sizes, ties, both paths (the C
    selection from 4,096 values)."""
    from specproxy.analyze.summary import median

    rng = np.random.default_rng(36)
    for n in (1, 2, 3, 4, 4095, 4096, 4097, 50_000, 50_001):
        for high in (3, 1 << 20):  # ties everywhere, and few
            ints = rng.integers(0, high, n)
            assert median(ints.astype(float)) == float(np.median(ints.tolist()))
            shares = ints / np.maximum(ints[::-1], 1)  # the new input's share: fractions
            assert median(shares) == float(np.median(shares.tolist()))
