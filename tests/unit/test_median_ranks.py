"""``_median_ranks`` computes only the terms of the binomial cdf it reads: (d, lambda) must be the whole-range
computation's to the last bit, at every size (a figure's interval ends are read at d and moved by lambda)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specproxy.analyze import summary


def whole_range_ranks(n: int, level: float) -> tuple[int, float] | None:
    """The previous implementation, kept as the reference: the cdf over all n//2 + 1 terms."""
    if n < 2:
        return None
    j = np.arange(n // 2 + 1)
    cdf = np.cumsum(np.exp(n * math.log(0.5) + np.concatenate(
        ([0.0], np.cumsum(np.log((n - j) / (j + 1.0)))))))
    d = np.arange(1, n // 2 + 1)
    gamma = 1.0 - 2.0 * cdf[d - 1]
    ok = np.nonzero(gamma >= level)[0]
    if ok.size == 0:
        return None
    d_best = int(d[ok[-1]])
    g_d = float(gamma[ok[-1]])
    g_next = float(1.0 - 2.0 * cdf[d_best]) if d_best < n // 2 else 0.0
    i = (g_d - level) / (g_d - g_next) if g_d > g_next else 0.0
    lam = (n - d_best) * i / (d_best + (n - 2 * d_best) * i) if i > 0 else 0.0
    return d_best, lam


def same(n: int, level: float) -> None:
    got, want = summary._median_ranks.__wrapped__(n, level), whole_range_ranks(n, level)
    assert (got is None) == (want is None), n
    if want is not None:
        assert got[0] == want[0] and type(got[0]) is int, n
        assert got[1].hex() == float(want[1]).hex(), n  # bit for bit


@pytest.mark.parametrize("level", [0.95, 0.9, 0.99, 0.51])
def test_every_small_size(level):
    for n in range(0, 5001):
        same(n, level)


def test_large_sizes_where_the_left_tail_underflows():
    rng = np.random.default_rng(36)
    sizes = [5001, 10_000, 65_536, 1_000_001, 2_000_000, *rng.integers(5_000, 3_000_000, 40).tolist()]
    for n in sizes:
        for level in (0.95, 0.99):
            same(int(n), level)
