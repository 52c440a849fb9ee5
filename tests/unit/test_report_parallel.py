"""The report's figures on a thread pool (``analyze/deferred.py``): they run beside the main thread, land in
the places they were asked for, and the report is the one computed without a pool, byte for byte."""

from __future__ import annotations

import threading

import numpy as np
import orjson
import pytest

from specproxy.analyze import deferred
from specproxy.analyze.report_data import REPORT_COLUMNS, build_report
from specproxy.analyze.summary import median_p95_max, summarize
from specproxy.store.source import Window
from specproxy.store.sqlite_source import SQLiteSource
from test_report_fast_path import bench_report_module


def _cores(monkeypatch, n: int) -> None:
    monkeypatch.setattr(deferred.os, "sched_getaffinity", lambda pid: set(range(n)))


def test_figures_run_on_the_pool_and_land_in_their_places(monkeypatch):
    _cores(monkeypatch, 4)
    assert deferred.workers() == deferred.MAX_WORKERS
    main = threading.current_thread().name
    with deferred.figures_in_parallel():
        tree = {"a": [deferred.later(lambda i: (i, threading.current_thread().name), i) for i in range(20)],
                "b": (deferred.later(lambda: "x"), 1), "c": {"d": None}}
        out = deferred.resolved(tree)
    assert [i for i, _ in out["a"]] == list(range(20))
    assert all(name != main and name.startswith("figures") for _, name in out["a"])
    assert out["b"] == ("x", 1) and out["c"] == {"d": None} and list(out) == ["a", "b", "c"]


def test_a_figure_on_the_pool_computes_its_own_figures_in_place(monkeypatch):
    _cores(monkeypatch, 2)
    with deferred.figures_in_parallel():
        outer = deferred.later(lambda: deferred.later(lambda: threading.current_thread().name))
        name = deferred.resolved(outer)
    assert name.startswith("figures")  # a value, not a Future: no worker waits for another


def test_parts_of_one_figure_land_in_their_places(monkeypatch):
    """One table's cells are computed in one pass (a list): each row's place holds its own item of it."""
    for cores in (2, 1):
        _cores(monkeypatch, cores)
        with deferred.figures_in_parallel():
            whole = deferred.later(lambda: [{"cell": i} for i in range(5)])
            tree = [{"row": b, "figure": deferred.part(whole, b)} for b in (4, 0, 2)]
            assert deferred.resolved(tree) == [{"row": b, "figure": {"cell": b}} for b in (4, 0, 2)]


def test_one_core_computes_in_place(monkeypatch):
    _cores(monkeypatch, 1)
    with deferred.figures_in_parallel():
        got = deferred.later(lambda: threading.current_thread().name)
    assert got == threading.current_thread().name  # no Future: computed where asked for


def test_a_figure_that_fails_fails_the_report(monkeypatch):
    _cores(monkeypatch, 2)
    with pytest.raises(ZeroDivisionError):
        with deferred.figures_in_parallel():
            deferred.resolved([deferred.later(lambda: 1 / 0)])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    gen = bench_report_module()
    gen.SPAN = 6 * 3600.0
    path = tmp_path_factory.mktemp("parallel") / "turns.db"
    gen.generate(path, 6000)
    with SQLiteSource(path, cache=False) as store:
        return store.load(Window(), REPORT_COLUMNS, server=True, context=True)


def test_the_report_on_two_cores_is_the_report_on_one(monkeypatch, data):
    _cores(monkeypatch, 2)
    calls = []
    real = deferred._Pool.submit
    monkeypatch.setattr(deferred._Pool, "submit", lambda self, fn, *a: calls.append(fn) or real(self, fn, *a))
    two = orjson.dumps(build_report(data, source="db"))
    assert len(calls) > 20  # the summaries and the tables' columns went to the pool
    _cores(monkeypatch, 1)
    one = orjson.dumps(build_report(data, source="db"))
    assert two == one  # keys in the same order too: no OPT_SORT_KEYS


def test_median_p95_max_is_numpys_to_the_last_bit():
    rng = np.random.default_rng(7)
    for n in [*range(1, 300), 1001, 4096, 99_999]:
        for x in (rng.lognormal(0, 1.5, n), np.round(rng.normal(8, 3, n)), rng.random(n) * 1e-300):
            med, p95, top = median_p95_max(x)
            assert med.hex() == float(np.median(x)).hex()
            assert p95.hex() == float(np.percentile(x, 95)).hex()
            assert top == float(x.max())


def test_a_strided_column_sums_as_its_copy():
    """summarize reads a column without copying it (a selection without copies may be a strided view): its
    figures are its copy's, the mean to the last bit."""
    x = np.random.default_rng(3).lognormal(0, 2, 100_003 * 3)
    strided = x[::3]
    assert summarize(strided) == summarize(strided.copy())
    assert summarize(strided).mean == float(strided.copy().mean())
