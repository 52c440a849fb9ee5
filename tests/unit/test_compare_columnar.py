"""compare's columnar paths (issue 36) give the numbers of the paths they replaced: the stable order of a
sort, labels as codes, a pooled quantile's replicates read from a band of the values, the t grid filled
where it is read, the API shares from a column's counts, numpy's quantile from two order statistics. Each
is held to the plain computation here."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specproxy.analyze import resample, tdist
from specproxy.analyze.arrays import Coded, clean_labelled, stable_argsort
from specproxy.analyze.compare import _clusters, _lanes
from specproxy.analyze.order_stats import quantile
from specproxy.analyze.workload import Workload
from specproxy.store.dataset import Turns


@pytest.mark.parametrize("shape", [(1000,), (3, 500), (0,), (1,)])
def test_stable_argsort_is_the_stable_permutation(shape):
    rng = np.random.default_rng(3)
    x = np.round(rng.normal(size=shape), 1)  # many ties
    if x.size > 10:
        x.reshape(-1)[::7] = np.nan
        x.reshape(-1)[::11] = -0.0
        x.reshape(-1)[::13] = 0.0
    assert np.array_equal(stable_argsort(x), np.argsort(x, axis=-1, kind="stable"))


def test_stable_argsort_without_ties():
    x = np.random.default_rng(4).random(5000)
    assert np.array_equal(stable_argsort(x), np.argsort(x, kind="stable"))


def test_coded_labels_give_the_object_labels_codes():
    rng = np.random.default_rng(5)
    objects = np.array(["i2", "i0", None, "i1"], dtype=object)[rng.integers(0, 4, 300)]
    values = rng.random(300)
    values[:40] = np.nan  # the first-seen order is over the kept values
    codes = Coded(np.array([{"i2": 0, "i0": 1, None: 2, "i1": 3}[o] for o in objects]), ("i2", "i0", None, "i1"))
    x1, lab1, uniq1 = clean_labelled(values, list(objects))
    x2, lab2, uniq2 = clean_labelled(values, codes)
    assert np.array_equal(x1, x2) and np.array_equal(lab1, lab2) and uniq1 == uniq2
    assert lab2.dtype == np.int64


def test_an_arms_instances_and_lanes_from_the_codes():
    ids = np.array(["b", None, "a", "unknown", "b", None], dtype=object)
    conn = np.array([7.0, 3.0, 7.0, np.nan, 3.0, 9.0])
    turns = Turns({"t_wall": np.arange(6.0), "conn_id": conn}, {"instance_id": ids})
    c = _clusters(turns)
    # the labels compare read before: str of each, "unknown" where NULL (one instance with a turn called so)
    assert [c.values[i] for i in c.codes] == ["b", "unknown", "a", "unknown", "b", "unknown"]
    lanes = _lanes(turns)
    assert [lanes.values[i] for i in lanes.codes] == [7, 3, 7, None, 3, 9]
    none = Turns({"t_wall": np.arange(2.0)}, {"instance_id": np.array([None, None], dtype=object)})
    assert _clusters(none) is None


@pytest.mark.parametrize("stat", ["median", "p95"])
@pytest.mark.parametrize("spread", [1.0, 1.02, 3.0])  # instances alike, a little apart, far apart (band fails)
@pytest.mark.parametrize("k", [2, 3, 5])
def test_pooled_quantile_replicates_from_the_band_are_those_from_every_value(monkeypatch, stat, spread, k):
    rng = np.random.default_rng([k, int(spread * 100)])
    lab = rng.integers(0, k, 20_000)
    x = np.round(rng.lognormal(size=lab.size) * spread ** lab, 2)  # ties, instances shifted by spread
    got = resample.boot_instances(x, lab, stat, 500, np.random.default_rng(1))
    monkeypatch.setattr(resample, "_band", lambda x, lab, k, *_: (x, lab, np.zeros(k, np.int64)))
    assert np.array_equal(got, resample.boot_instances(x, lab, stat, 500, np.random.default_rng(1)))


@pytest.mark.parametrize("spread", [1.0, 1.3])
def test_the_band_estimated_from_a_sample_gives_the_same_replicates(monkeypatch, spread):
    """Past ``_SAMPLE`` values the band's bounds come from every s-th value; the replicates do not change."""
    rng = np.random.default_rng(int(spread * 10))
    lab = np.repeat([0, 1, 2], 100_000)  # instances one after another, as restarts are in time
    x = np.round(rng.lognormal(size=lab.size) * spread ** lab, 3)
    assert x.size > 2 * resample._SAMPLE
    for stat in ("median", "p95"):
        got = resample.boot_instances(x, lab, stat, 300, np.random.default_rng(2))
        with monkeypatch.context() as m:
            m.setattr(resample, "_band", lambda x, lab, k, *_: (x, lab, np.zeros(k, np.int64)))
            assert np.array_equal(got, resample.boot_instances(x, lab, stat, 300, np.random.default_rng(2)))


@pytest.mark.parametrize("df", [4.0, 4.7, 9.3, 40.0, 1e6, math.inf])
def test_t_quantiles_read_the_grid_points_they_need(df):
    p = 0.975
    tdist._t_grid.cache_clear()
    got = tdist.t_quantiles(p, np.array([df]))
    grid = np.array([tdist.t_ppf(p, 1.0 / x if x > 0 else math.inf) for x in tdist._INV_DF])
    assert got[0] == np.interp(1.0 / df, tdist._INV_DF, grid)
    assert np.isnan(tdist._t_grid(p)).sum() >= tdist._INV_DF.size - 4  # two points per df, not the grid


def test_api_shares_from_the_counts():
    api = np.array(["chat", None, "messages", "chat", "responses"], dtype=object)
    turns = Turns({"t_wall": np.arange(5.0)}, {"api": api})
    names, counts = np.unique(np.array([str(v) for v in api], dtype=object), return_counts=True)
    shares = Workload(turns).shares("api")
    assert shares == {str(k): float(c) / 5 for k, c in zip(names, counts)}
    assert list(shares) == [str(k) for k in names]  # in the order of the texts, as the JSON has them


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 19, 20, 100, 4095, 4096, 4097, 50_001])
@pytest.mark.parametrize("q", [0.5, 0.95])
def test_quantile_from_order_statistics_is_numpys(n, q):
    rng = np.random.default_rng([n, int(q * 100)])
    for x in (rng.lognormal(size=n), np.round(rng.lognormal(size=n), 1), rng.random(n) * 1e-300):
        before = x.copy()
        assert quantile(x, q) == float(np.quantile(x, q))
        assert np.array_equal(x, before)  # left as it was
