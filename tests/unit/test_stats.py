"""Tests for specproxy.analyze.stats, .summary and .instances: the intervals are checked by simulation, not by example.

Every simulation is seeded and vectorised where it can be; the measured rates are printed
(run with -s to see them) so a change in calibration shows up as numbers, not only as a failure.
Noise model: lognormal with 15% coefficient of variation, a typical run-to-run spread of inference benchmarks.
"""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from specproxy.analyze.cells import concurrency_bucket, prompt_bucket, which_to_read
from specproxy.analyze.instances import (CONFOUNDED_WARNING, SEPARATE_INSTANCES_WARNING, instance_warning,
                                         unknown_instances_warning)
from specproxy.analyze.stats import Ratio, bootstrap_ratio, median_tail, percentile_interval
from specproxy.analyze.summary import Summary, median_ci, summarize
from specproxy.analyze.wording import plural
from specproxy.analyze.control import negative_control
from specproxy.analyze.tdist import t_ppf as _t_ppf
from specproxy.analyze.throughput import aggregate_throughput, aggregate_throughput_interval

SIG15 = math.sqrt(math.log(1 + 0.15**2))  # lognormal sigma for a 15% CV
ND = "not distinguishable"


def _rate(results) -> float:
    return float(np.mean([r.verdict != ND for r in results]))


# ----------------------------------------------------------------------------- Summary

@pytest.mark.parametrize("n", [15, 200])
def test_median_ci_coverage_on_skewed_data(n):
    rng = np.random.default_rng(1000 + n)
    samples = np.sort(rng.lognormal(0.0, 1.0, (1000, n)), axis=1)  # true median = 1
    cover = np.mean([lo <= 1.0 <= hi for lo, hi in (median_ci(s) for s in samples)])
    print(f"\nmedian CI coverage, n={n}: {cover:.3f}")
    assert 0.93 <= cover <= 0.97


def test_summarize_no_data_is_none_not_zero():
    for empty in ([], None, [None], [float("nan"), None]):
        s = summarize(empty)
        assert s == Summary(0, None, None, None, None, None)
        assert s.to_dict() == {"n": 0, "median": None, "mean": None, "p95": None,
                               "ci_low": None, "ci_high": None}


def test_summarize_drops_missing_values():
    s = summarize([1.0, None, 3.0, float("nan"), 2.0])
    assert (s.n, s.median, s.mean) == (3, 2.0, 2.0)
    assert summarize(np.array([1.0, np.nan, 3.0])).n == 2


def test_summarize_rejects_infinity():
    with pytest.raises(ValueError, match="infinite"):
        summarize([1.0, math.inf])


def test_summarize_figures_match_numpy():
    x = np.random.default_rng(7).lognormal(1.0, 0.5, 101)
    s = summarize(list(x))
    assert s.median == pytest.approx(np.median(x))
    assert s.mean == pytest.approx(np.mean(x))
    assert s.p95 == pytest.approx(np.percentile(x, 95))
    json.dumps(s.to_dict())  # plain floats, serialisable


def test_too_few_values_for_a_95_interval():
    # with 5 values even [min, max] covers the median only 1 - 2/32 = 93.75% of the time
    assert summarize([1, 2, 3, 4, 5]).ci_low is None
    s = summarize([1, 2, 3, 4, 5, 6])
    assert s.ci_low is not None and 1 <= s.ci_low <= s.median <= s.ci_high <= 6


@settings(derandomize=True, max_examples=200, deadline=None)
@given(st.lists(st.floats(0.001, 1e6), min_size=6, max_size=300))
def test_median_ci_brackets_median_within_data(xs):
    s = summarize(xs)
    assert min(xs) <= s.ci_low <= s.median <= s.ci_high <= max(xs)


def test_summarize_100k_values():  # a benchmark in disguise: must simply not be slow
    x = np.random.default_rng(3).lognormal(0.0, 1.0, 100_000)
    s = summarize(x)
    assert s.n == 100_000
    assert s.ci_low < s.median < s.ci_high and s.ci_high - s.ci_low < 0.03


# ----------------------------------------------------------------------------- A/B ratios

def test_negative_control_false_positive_rate():
    rng = np.random.default_rng(11)
    samples = rng.lognormal(0.0, SIG15, (1000, 30))  # split into halves of 15
    fp = _rate(negative_control(x, seed=i) for i, x in enumerate(samples))
    print(f"\nnegative control (15 vs 15, 15% CV): distinguishable {fp:.3f}")
    assert 0.03 <= fp <= 0.07


@pytest.mark.parametrize("stat", ["median", "mean"])
def test_aa_false_positive_rate(stat):
    rng = np.random.default_rng(12)
    a, b = rng.lognormal(0.0, SIG15, (2, 1000, 15))
    fp = _rate(bootstrap_ratio(x, y, higher_is_better=True, stat=stat, seed=i)
               for i, (x, y) in enumerate(zip(a, b)))
    print(f"\nA/A {stat}, n=15 per arm: distinguishable {fp:.3f}")
    assert 0.03 <= fp <= 0.07


def test_power_for_a_true_10_percent_speedup():
    """Honest power is low at n=15: ~25%. Asserted as a band, since higher would mean the
    interval is too narrow. n=60 per arm is what finding 10% at 15% CV most of the time takes."""
    rng = np.random.default_rng(13)
    power = {}
    for n, sims in ((15, 1000), (60, 400)):
        a = rng.lognormal(0.0, SIG15, (sims, n))
        b = 1.10 * rng.lognormal(0.0, SIG15, (sims, n))
        res = [bootstrap_ratio(x, y, higher_is_better=True, seed=i)
               for i, (x, y) in enumerate(zip(a, b))]
        assert all(r.verdict != "slower" for r in res)
        power[n] = _rate(res)
    print(f"\npower for +10% at 15% CV: n=15 {power[15]:.3f}, n=60 {power[60]:.3f}")
    assert 0.15 <= power[15] <= 0.40
    assert power[60] >= 0.65


def test_median_interval_holds_its_estimate():
    """The estimate is the sample median ratio, the interval comes from smoothed replicates: where
    they disagree (replicates all above the estimate here), the bound moves to the estimate."""
    rng = np.random.default_rng(21)
    d = rng.uniform(0.1, 0.3, (1, 2000))  # log ratios of the replicates
    lo, hi, verdict = percentile_interval(np.array([1.0]), (np.zeros((1, 2000)), 15), (d, 15), 0.95, True)
    tail = median_tail(15, 15, 0.95)
    assert lo[0] == 1.0 and hi[0] == pytest.approx(math.exp(np.quantile(d, 1.0 - tail))) and verdict[0] == ND


def test_median_tail_offsets_the_replicates_excess_and_noise():
    """Equal arms: the replicates' spread runs high, so the interval is read further in than the
    nominal 2.5% a side; one small arm against a large one: the small arm's noisy spread needs
    the t quantile, further out. Any level is calibrated, and the order of the arms is immaterial."""
    assert 0.028 < median_tail(8, 8, 0.95) < median_tail(15, 15, 0.95) < 0.04
    assert median_tail(7, 200, 0.95) < 0.025 < median_tail(200, 200, 0.95)
    assert median_tail(7, 200, 0.95) == median_tail(200, 7, 0.95)
    assert 0.05 < median_tail(15, 15, 0.90) < 0.07


@settings(derandomize=True, max_examples=100, deadline=None)
@given(st.lists(st.floats(0.001, 1e6), min_size=5, max_size=80),
       st.lists(st.floats(0.001, 1e6), min_size=5, max_size=80))
def test_median_ratio_interval_contains_the_estimate(a, b):
    r = bootstrap_ratio(a, b, higher_is_better=True)
    assert r.ci_low <= r.estimate <= r.ci_high and "percentile" in r.method


def test_verdict_direction_follows_higher_is_better():
    rng = np.random.default_rng(14)
    a = rng.lognormal(0.0, SIG15, 40)
    b = 2.0 * rng.lognormal(0.0, SIG15, 40)
    speed = bootstrap_ratio(a, b, higher_is_better=True)
    time = bootstrap_ratio(a, b, higher_is_better=False)
    assert speed.verdict == "faster" and time.verdict == "slower"
    assert speed.ci_low > 1 and speed.estimate == pytest.approx(np.median(b) / np.median(a))
    assert bootstrap_ratio(b, a, higher_is_better=False).verdict == "faster"


def _one_instance_arm(rng, n, inst_sd=0.1):
    return math.exp(rng.normal(0.0, inst_sd)) * rng.lognormal(0.0, SIG15, n)


def test_restart_confounding_single_instances_are_not_a_verdict():
    rng = np.random.default_rng(15)
    naive, clustered = [], []
    for i in range(300):
        a, b = _one_instance_arm(rng, 15), _one_instance_arm(rng, 15)
        naive.append(bootstrap_ratio(a, b, higher_is_better=True, seed=i))
        clustered.append(bootstrap_ratio(a, b, higher_is_better=True, seed=i,
                                         clusters_a=["run-1"] * 15, clusters_b=["run-2"] * 15))
    print(f"\none instance per arm, 10% instance sd: naive says distinguishable "
          f"{_rate(naive):.3f}")
    assert _rate(naive) > 0.2  # the trap this guards against
    assert all(r.verdict == ND for r in clustered)
    # the precise warning alone: "inside one instance" beside it would contradict it
    assert all(SEPARATE_INSTANCES_WARNING in r.warnings and CONFOUNDED_WARNING not in r.warnings
               for r in clustered)
    assert all((r.instances_a, r.instances_b) == (1, 1) for r in clustered)


def test_same_single_instance_still_gives_a_verdict_with_the_warning():
    rng = np.random.default_rng(16)
    a, b = rng.lognormal(0.0, SIG15, 30), 1.5 * rng.lognormal(0.0, SIG15, 30)
    r = bootstrap_ratio(a, b, higher_is_better=True, clusters_a=[7] * 30, clusters_b=[7] * 30)
    assert r.verdict == "faster" and CONFOUNDED_WARNING in r.warnings


def _multi_instance_arm(rng, k, m, offset, inst_sd=0.1):
    effect = np.exp(rng.normal(0.0, inst_sd, k))
    labels = np.repeat(np.arange(k), m)
    return effect[labels] * rng.lognormal(0.0, SIG15, k * m), labels + offset


def test_clustered_interval_is_wider_and_honest():
    rng = np.random.default_rng(17)
    naive, clustered = [], []
    for i in range(300):
        a, la = _multi_instance_arm(rng, 4, 15, 0)
        b, lb = _multi_instance_arm(rng, 4, 15, 100)
        naive.append(bootstrap_ratio(a, b, higher_is_better=True, seed=i))
        clustered.append(bootstrap_ratio(a, b, higher_is_better=True, seed=i,
                                         clusters_a=la, clusters_b=lb))
    width = lambda rs: np.mean([math.log(r.ci_high / r.ci_low) for r in rs])  # noqa: E731
    print(f"\n4 instances x 15 per arm, A/A: distinguishable naive {_rate(naive):.3f}, "
          f"clustered {_rate(clustered):.3f}; log-width {width(naive):.3f} vs "
          f"{width(clustered):.3f}")
    wider = np.mean([c.ci_high - c.ci_low > n.ci_high - n.ci_low
                     for c, n in zip(clustered, naive)])
    print(f"clustered interval wider than the naive one in {wider:.3f} of the comparisons")
    assert width(clustered) > 2 * width(naive) and wider >= 0.9
    assert _rate(naive) > 0.15
    assert _rate(clustered) <= 0.07
    assert clustered[0].instances_a == 4 and "4 instances" in clustered[0].method


def test_single_instance_arm_borrows_instance_variance():
    rng = np.random.default_rng(18)
    res = []
    for i in range(300):
        a = _one_instance_arm(rng, 15)
        b, lb = _multi_instance_arm(rng, 4, 15, 100)
        res.append(bootstrap_ratio(a, b, higher_is_better=True, seed=i,
                                   clusters_a=[0] * 15, clusters_b=lb))
    print(f"\n1 instance vs 4 instances, A/A: distinguishable {_rate(res):.3f}")
    assert _rate(res) <= 0.09
    # not "an A/B inside one server instance": the other arm ran in four; the borrowing is said instead
    assert all(CONFOUNDED_WARNING not in r.warnings and any("borrowed from arm b's 4 instances" in w
                                                            for w in r.warnings) for r in res)


def test_negative_control_splits_by_instance():
    rng = np.random.default_rng(19)
    x, labels = _multi_instance_arm(rng, 6, 10, 0)
    r = negative_control(x, list(labels), seed=3)
    assert (r.instances_a, r.instances_b, r.n_a + r.n_b) == (3, 3, 60)
    r2 = negative_control(x[:20], list(labels[:20]), seed=3)  # two instances: one each, never a verdict
    assert r2.verdict == "no interval (2 instances: a negative control over instances needs at least 4 per arm)"
    assert r2.warnings[0].startswith("this arm ran in 2 server instances, so a split by instance is 1 against 1")
    assert (r2.instances_a, r2.instances_b, r2.ci_low) == (1, 1, None)


def test_instance_warning_fits_the_arms_instances():
    assert instance_warning({"x"}, {"x"}) == CONFOUNDED_WARNING
    assert instance_warning({"x"}, {"y"}) == SEPARATE_INSTANCES_WARNING
    # one arm's instances unknown (a server without /metrics): said so, not "inside one instance"
    assert instance_warning({"x"}, None) == unknown_instances_warning("b")
    assert instance_warning(None, ["y"]) == unknown_instances_warning("a")
    assert instance_warning({"x"}, {"y", "z"}) is None and instance_warning(None, None) is None
    assert instance_warning({"x", "y"}, {"x", "y"}) is None


def test_plural():
    assert (plural(1, "instance"), plural(2, "instance"), plural(0, "turn"), plural(None, "instance")) == (
        "1 instance", "2 instances", "0 turns", "instances unknown")


def test_ratio_missing_and_tiny_arms():
    r = bootstrap_ratio([], [1.0, 2.0], higher_is_better=True)
    assert r.estimate is None and "no data in arm a" in r.warnings
    assert r.verdict == "no interval (no data in arm a)"  # not "not distinguishable": no comparison
    r = bootstrap_ratio([1.0, None, 2.0, 3.0], [10.0, 20.0, 30.0, float("nan")],
                        higher_is_better=True)
    assert (r.n_a, r.n_b) == (3, 3) and r.estimate == pytest.approx(10.0)
    assert r.ci_low is None and r.verdict == "no interval (fewer than 5 values in an arm)"
    with pytest.raises(ValueError):
        bootstrap_ratio([1.0] * 5, [1.0] * 5, higher_is_better=True, clusters_a=[1, 2])
    json.dumps(r.to_dict())
    assert isinstance(r, Ratio)


def test_ratio_is_deterministic_and_antisymmetric():
    rng = np.random.default_rng(20)
    a, b = rng.lognormal(0.0, SIG15, (2, 25))
    r1 = bootstrap_ratio(a, b, higher_is_better=True, seed=5)
    assert r1 == bootstrap_ratio(a, b, higher_is_better=True, seed=5)
    r2 = bootstrap_ratio(b, a, higher_is_better=True, seed=5)
    assert r1.estimate == pytest.approx(1.0 / r2.estimate)


def test_t_quantiles():
    for df, want in ((1, 12.7062), (2, 4.3027), (5, 2.5706), (30, 2.0423), (math.inf, 1.9600)):
        assert _t_ppf(0.975, df) == pytest.approx(want, abs=1e-4)


# ----------------------------------------------------------------------------- throughput

def test_aggregate_throughput():
    # 3 complete requests over the window 0..10 s; the incomplete row is dropped whole
    assert aggregate_throughput([100, 200, 300, None], [0, 2, 4, 5], [5, 8, 10, 6]) == 60.0
    assert aggregate_throughput([], [], []) is None
    assert aggregate_throughput([5], [1.0], [1.0]) is None  # no elapsed time
    with pytest.raises(ValueError):
        aggregate_throughput([1], [2.0], [1.0])


def test_aggregate_throughput_interval():
    rng = np.random.default_rng(21)
    tokens = rng.integers(50, 500, 200)
    starts = np.sort(rng.uniform(0, 100, 200))
    t = aggregate_throughput_interval(tokens, starts, starts + 5.0)
    assert t.n == 200 and t.ci_low < t.value < t.ci_high
    assert t.value == pytest.approx(aggregate_throughput(tokens, starts, starts + 5.0))
    assert aggregate_throughput_interval([], [], []).value is None


# ----------------------------------------------------------------------------- which cell

def test_buckets_and_which_to_read():
    got = [concurrency_bucket(c) for c in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 500)]
    assert got == ["1", "2", "3-4", "3-4", "5-8", "5-8", "9-16", "9-16", "17-32", "17-32",
                   "33-64", "33-64", "65+", "65+"]
    assert concurrency_bucket(2.5) == "3-4" and concurrency_bucket(None) is None
    with pytest.raises(ValueError):
        concurrency_bucket(0)
    assert [prompt_bucket(t) for t in (0, 1023, 1024, 8112, 16384, 65536)] == [
        "<1k", "<1k", "1k-4k", "4k-16k", "16k-64k", "64k+"]
    assert prompt_bucket(None) is None
    assert [which_to_read(c) for c in (1, 4, 4.5, 8, None)] == [
        "per-stream", "per-stream", "aggregate", "aggregate", None]


def test_median_ci_never_steps_past_the_median_by_rounding():
    # ties around the median: interpolating between equal order statistics must return them exactly
    xs = [0.001] * 60 + [1.0] * 20 + [3.3] * 40 + [1e6] * 55
    s = summarize(xs)
    assert s.ci_low <= s.median <= s.ci_high


def test_vectorised_buckets_agree_with_the_scalar_ones():
    from specproxy.analyze.cells import (CONCURRENCY_BUCKETS, PROMPT_BUCKETS, concurrency_bucket, concurrency_buckets,
                                         prompt_bucket, prompt_buckets)

    conc = np.array([1, 2, 2.5, 3, 4, 4.0001, 8, 9, 64, 65, 1000, np.nan])
    idx = concurrency_buckets(conc)
    assert [CONCURRENCY_BUCKETS[i] if i >= 0 else None for i in idx] == [concurrency_bucket(c) if np.isfinite(c) else None for c in conc]
    toks = np.array([0, 1023, 1024, 4095, 4096, 16383, 16384, 65535, 65536, 10**6, np.nan])
    idx = prompt_buckets(toks)
    assert [PROMPT_BUCKETS[i] if i >= 0 else None for i in idx] == [prompt_bucket(t) if np.isfinite(t) else None for t in toks]


@pytest.mark.parametrize("stat", ["median", "mean", "p95"])
@pytest.mark.parametrize("instances", [False, True])
def test_a_99_percent_ratio_interval_holds_the_95_percent_one(stat, instances):
    """Every rule under compare's rows honours ``level``: the median's calibrated percentile tail, the
    t/normal rule on bootstrap variances, over requests or over instances."""
    rng = np.random.default_rng(7)
    a, b = rng.lognormal(0.0, SIG15, 120), 1.1 * rng.lognormal(0.0, SIG15, 120)
    clusters = {"clusters_a": np.repeat(["a1", "a2", "a3", "a4"], 30),
                "clusters_b": np.repeat(["b1", "b2", "b3", "b4"], 30)} if instances else {}
    r95, r99 = (bootstrap_ratio(a, b, higher_is_better=True, stat=stat, level=level, **clusters)
                for level in (0.95, 0.99))
    assert r99.ci_low < r95.ci_low <= r95.estimate <= r95.ci_high < r99.ci_high
    assert (r95.level, r99.level, r99.method) == (0.95, 0.99, r95.method)


def test_the_median_tail_and_order_statistic_interval_widen_with_the_level():
    assert median_tail(30, 30, 0.99) < median_tail(30, 30, 0.95) / 3
    x = np.random.default_rng(3).lognormal(0.0, SIG15, 50)
    (lo95, hi95), (lo99, hi99) = median_ci(x, 0.95), median_ci(x, 0.99)
    assert lo99 < lo95 < hi95 < hi99


def test_buckets_and_groups_of_a_column_are_the_binary_search_and_the_sort():
    """The comparison passes give numpy.searchsorted's buckets at every edge and between them, and the
    cells of one sort are each cell's positions, whatever the width of the cell numbers."""
    from specproxy.analyze import cells

    rng = np.random.default_rng(5)
    edges_c = np.asarray(cells._CONC_EDGES, dtype=float)
    edges_p = np.asarray(cells._PROMPT_EDGES, dtype=float)
    c = np.concatenate([edges_c, edges_c + 0.5, edges_c - 0.5, rng.integers(1, 600, 500), [np.nan, 1.0, 1e9]])
    t = np.concatenate([edges_p, edges_p + 1, edges_p - 1, rng.integers(0, 100_000, 500), [np.nan, 0.0, 1e12]])
    assert cells.concurrency_buckets(c).tolist() == np.where(
        np.isfinite(c), np.searchsorted(edges_c, c, side="left"), -1).tolist()
    assert cells.prompt_buckets(t).tolist() == np.where(
        np.isfinite(t), np.searchsorted(edges_p, t, side="right"), -1).tolist()
    for top, dtype in ((3, np.int64), (3, np.int8), (127, np.int64), (300, np.int64), (40_000, np.int64)):
        index = rng.integers(-1, top, 2000).astype(dtype)  # cell numbers of 8, 16 and 64 bits
        index[index == 1] = -1  # an empty cell is left out
        want = [(b, np.flatnonzero(index == b)) for b in range(top) if (index == b).any()]
        got = cells.groups(index)
        assert [b for b, _ in got] == [b for b, _ in want]
        assert all(np.array_equal(g, w) for (_, g), (_, w) in zip(got, want))


def test_a_concurrency_cell_on_one_side_of_the_threshold_reads_that_side_for_any_median():
    """``bucket_side`` against ``which_to_read`` of the median of draws of each cell's values, at its edges
    and inside: every cell lies on one side of the threshold, and its side is the answer for any median."""
    from specproxy.analyze import cells

    rng = np.random.default_rng(11)
    c = np.concatenate([rng.integers(1, 200, 5000).astype(float), rng.uniform(0.5, 100, 5000),
                        np.asarray(cells._CONC_EDGES, dtype=float), [0.5, 1e9]])
    index = cells.concurrency_buckets(c)
    for b in range(len(cells.CONCURRENCY_BUCKETS)):
        values = c[index == b]
        assert len(values)
        medians = {cells.which_to_read(float(np.median(rng.choice(values, k)))) for k in (1, 2, 3, 10, 100)}
        medians |= {cells.which_to_read(float(values.min())), cells.which_to_read(float(values.max()))}
        side = cells.bucket_side(b)
        assert medians == {side}, (b, side, medians)
    assert [cells.bucket_side(b) for b in range(len(cells.CONCURRENCY_BUCKETS))] == \
        ["per-stream", "per-stream", "per-stream", *["aggregate"] * 5]
