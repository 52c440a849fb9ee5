"""specproxy.analyze._orderc, order statistics by radix selection in C, held to numpy's partition.

``order_stats.order_statistics_reference`` (``numpy.partition``) is the reference: for any finite
float64 values and ranks, the C path returns the same values (equal as floats: +0.0 and -0.0 tie, and
either may sit at a rank in both), and it leaves its input as it was.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specproxy.analyze import order_stats
from specproxy.analyze.order_stats import order_statistics_reference

pytestmark = pytest.mark.skipif(not order_stats.NATIVE, reason="specproxy.analyze._orderc is not built")


def test_orderc_is_built_where_required():
    """CI sets SPECPROXY_REQUIRE_RELAYC=1 (it requires every C module): a silent fallback fails here."""
    if os.environ.get("SPECPROXY_REQUIRE_RELAYC") != "1":
        pytest.skip("SPECPROXY_REQUIRE_RELAYC is not set")
    assert order_stats.NATIVE


def _native(x: np.ndarray, ranks: list[int]) -> list[float]:
    return list(order_stats._orderc.select(np.ascontiguousarray(x, dtype=np.float64), tuple(ranks)))


def _ranks(n: int, rng: np.random.Generator, k: int = 8) -> list[int]:
    return sorted({0, n - 1, (n - 1) // 2, n // 2, *rng.integers(0, n, k).tolist()})


def _same(x: np.ndarray, ranks: list[int]) -> None:
    before = x.copy()
    want = order_statistics_reference(x, ranks)
    got = _native(x, ranks)
    assert got == [float(want[k]) for k in ranks]
    assert np.array_equal(x, before)  # read in place, never moved


# the shapes a report's columns take: spread over many binades, packed into one, integers, few values
SHAPES = {
    "lognormal latencies": lambda rng, n: rng.lognormal(-1.0, 0.6, n),
    "one binade": lambda rng, n: 0.25 + rng.random(n) * 0.25,
    "integers 1-64": lambda rng, n: rng.integers(1, 65, n).astype(float),
    "token counts": lambda rng, n: rng.integers(0, 200_000, n).astype(float),
    "all equal": lambda rng, n: np.full(n, 3.5),
    "two values": lambda rng, n: rng.choice([0.0, 1.0], n),
    "signs and zeros": lambda rng, n: rng.normal(0, 1, n) * rng.integers(0, 2, n),
    "extremes": lambda rng, n: rng.choice([-1e308, -5e-324, 0.0, 5e-324, 1e-300, 1.0, 1e308], n),
    "nearly equal": lambda rng, n: 1.0 + rng.integers(0, 4, n) * np.finfo(float).eps,
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 1000, 100_003])
def test_the_same_order_statistics_as_numpys_partition(shape, n):
    rng = np.random.default_rng(n)  # seeded: the same values every run
    x = SHAPES[shape](rng, n)
    _same(x, _ranks(n, rng))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=400), st.data())
def test_any_finite_values_and_ranks(values, data):
    x = np.array(values, dtype=float)
    ranks = sorted(data.draw(st.lists(st.integers(0, len(x) - 1), min_size=1, max_size=16)))
    _same(x, ranks)


def test_a_rank_repeated_and_sixteen_ranks():
    rng = np.random.default_rng(7)
    x = rng.lognormal(0, 2, 50_000)
    _same(x, [5, 5, 5])
    _same(x, sorted(rng.integers(0, len(x), 16).tolist()))


def test_negative_zero_ties_with_zero():
    x = np.array([0.0, -0.0] * 5000 + [1.0] * 10)
    assert _native(x, [0, 9999, 10009]) == [0.0, 0.0, 1.0]


@pytest.mark.parametrize("ranks, why", [((), "1 to 16"), (tuple(range(17)), "1 to 16"), ((3, 2), "ascending"),
                                        ((10,), "ascending"), ((-1,), "ascending")])
def test_bad_ranks_are_refused(ranks, why):
    with pytest.raises(ValueError, match=why):
        order_stats._orderc.select(np.arange(10, dtype=float), ranks)


def test_the_wrapper_reads_each_rank_once_and_falls_back_for_small_and_odd_input():
    rng = np.random.default_rng(3)
    x = rng.lognormal(0, 1, 20_000)
    want = order_statistics_reference(x, [1, 10_000, 19_999])
    assert order_stats.order_statistics(x, [19_999, 1, 10_000, 1]) == want
    assert order_stats.order_statistics(x[:100], [0, 50]) == order_statistics_reference(x[:100], [0, 50])
    strided = x[::2]  # not contiguous: read through a contiguous copy
    assert order_stats.order_statistics(strided, [0, 5000]) == order_statistics_reference(strided, [0, 5000])
