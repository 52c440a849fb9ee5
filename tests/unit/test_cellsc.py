"""specproxy.analyze._cellsc, a report table's cells in one pass per column, held to ``by_cell``'s numpy
references bit for bit: each cell's finite values (in row order, so the same means and order statistics)
and each cell's aggregate throughput (the same busy periods, added as numpy adds them). And the report
computed by it is the report computed by the references, byte for byte."""

from __future__ import annotations

import os

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specproxy.analyze import by_cell
from specproxy.analyze.by_cell import (buckets, buckets_reference, cell_counts, finite_by_cell, finite_by_cell_reference,
                                       text_cells, text_values, throughput_by_cell, throughput_by_cell_reference)
from specproxy.store.turns import Turns
from specproxy.analyze.report_data import build_report
from test_report_parallel import data  # noqa: F401 (the fixture: a generated window as the report loads it)

pytestmark = pytest.mark.skipif(not by_cell.NATIVE, reason="specproxy.analyze._cellsc is not built")


def test_cellsc_is_built_where_required():
    """CI sets SPECPROXY_REQUIRE_RELAYC=1 (it requires every C module): a silent fallback fails here."""
    if os.environ.get("SPECPROXY_REQUIRE_RELAYC") != "1":
        pytest.skip("SPECPROXY_REQUIRE_RELAYC is not set")
    assert by_cell.NATIVE


def _bits(a: np.ndarray) -> list[int]:
    return np.ascontiguousarray(a, dtype=np.float64).view(np.uint64).tolist()  # -0.0 is not 0.0 here


def _same_cells(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert _bits(g) == _bits(w)


def _same_throughputs(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert list(g) == list(w)
        for k in g:
            assert (g[k] is None and w[k] is None) or (float(g[k]).hex() == float(w[k]).hex()), (k, g, w)


# a column's values: numbers, repeated ones and missing ones; now and then an infinite one (refused)
values_st = (st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=False), st.integers(0, 5).map(float)),
                      min_size=0, max_size=300)
             | st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=0, max_size=20))


@st.composite
def rows(draw, n: int):
    """A selection's positions (ascending, or None: every row), each row's cell (or None) and a mask (or None)."""
    if draw(st.booleans()):
        positions = None
        count = n
    else:
        positions = np.array(sorted(draw(st.sets(st.integers(0, max(n - 1, 0)), max_size=n))) if n else [],
                             dtype=np.int64)
        count = len(positions)
    ncell = draw(st.integers(1, 6))
    cells = None
    if draw(st.booleans()):
        dtype = draw(st.sampled_from([np.int8, np.int16, np.int32, np.int64]))
        cells = np.array(draw(st.lists(st.integers(-1, ncell - 1), min_size=count, max_size=count)), dtype=dtype)
    mask = None
    if draw(st.booleans()):
        mask = np.array(draw(st.lists(st.booleans(), min_size=count, max_size=count)), dtype=bool)
    return positions, cells, ncell, mask


@settings(max_examples=400, deadline=None)
@given(values_st, st.data())
def test_finite_by_cell_is_the_reference(values, drawn):
    """The same values cell by cell, or the same refusal of an infinite one (a figure is a number or missing)."""
    x = np.array(values, dtype=np.float64)
    positions, cells, ncell, mask = drawn.draw(rows(len(x)))
    try:
        want = finite_by_cell_reference(x, positions, cells, ncell, mask)
    except ValueError as exc:
        with pytest.raises(ValueError, match=str(exc)):
            finite_by_cell(x, positions, cells, ncell, mask)
        return
    _same_cells(finite_by_cell(x, positions, cells, ncell, mask), want)


@pytest.mark.parametrize("seed", range(6))
def test_finite_by_cell_over_many_rows(seed):
    """The shapes of a month: NaNs sprinkled, most rows selected, cells in runs (a concurrency bucket holds
    for a while), int8 cells with a mask and without."""
    rng = np.random.default_rng(seed)
    n = 200_003
    x = rng.lognormal(0, 1, n)
    x[rng.random(n) < 0.03] = np.nan
    positions = np.flatnonzero(rng.random(n) < 0.95)
    cells = np.repeat(rng.integers(-1, 8, len(positions) // 50 + 1), 50)[:len(positions)].astype(np.int8)
    mask = rng.random(len(positions)) < 0.97
    for p, c, m in ((positions, cells, mask), (positions, cells, None), (None, None, None), (positions, None, mask)):
        ncell = 8 if c is not None else 1
        _same_cells(finite_by_cell(x, p, c, ncell, m), finite_by_cell_reference(x, p, c, ncell, m))


def _column(drawn, n: int, elements) -> np.ndarray:
    return np.array(drawn.draw(st.lists(elements, min_size=n, max_size=n)), dtype=np.float64)


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 120), st.booleans(), st.data())
def test_throughput_by_cell_is_the_reference(n, in_order, drawn):
    """Starts in order or not, ends before their starts or NaN, token counts whole or not, missing or not:
    the C pass and the reference agree (a cell it cannot vouch for is the reference's own)."""
    starts = _column(drawn, n, st.floats(0, 100, allow_nan=False) | st.just(float("nan")))
    if in_order:
        starts = np.sort(starts)
    total = _column(drawn, n, st.floats(-1, 30) | st.just(float("nan")) | st.integers(0, 5).map(float))
    tokens = _column(drawn, n, st.integers(0, 500).map(float) | st.floats(0, 10) | st.just(float("nan")))
    positions, cells, ncell, _ = drawn.draw(rows(n))
    _same_throughputs(throughput_by_cell(starts, total, tokens, positions, cells, ncell),
                      throughput_by_cell_reference(starts, total, tokens, positions, cells, ncell))


def test_throughput_by_cell_over_many_rows():
    rng = np.random.default_rng(11)
    n = 300_001
    starts = np.cumsum(rng.exponential(0.05, n))
    total = rng.lognormal(0, 1, n)
    tokens = rng.integers(1, 800, n).astype(float)
    tokens[rng.random(n) < 0.01] = np.nan
    positions = np.flatnonzero(rng.random(n) < 0.9)
    cells = np.repeat(rng.integers(-1, 8, len(positions) // 40 + 1), 40)[:len(positions)].astype(np.int8)
    got = throughput_by_cell(starts, total, tokens, positions, cells, 8)
    _same_throughputs(got, throughput_by_cell_reference(starts, total, tokens, positions, cells, 8))
    assert all(g["tps"] is not None for g in got)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_cell_counts_are_numpys(drawn):
    _, cells, ncell, mask = drawn.draw(rows(drawn.draw(st.integers(0, 200))))
    if cells is None:
        return
    keep = (cells >= 0) if mask is None else (cells >= 0) & mask
    want = np.bincount(cells[keep].astype(np.intp), minlength=ncell)[:ncell].tolist()
    assert cell_counts(cells, ncell, mask).tolist() == want


@settings(max_examples=300, deadline=None)
@given(values_st, st.lists(st.integers(-5, 70000), max_size=8).map(lambda e: tuple(sorted(e))), st.booleans(),
       st.data())
def test_buckets_are_the_reference(values, edges, inclusive, drawn):
    x = np.array(values, dtype=np.float64)
    positions, *_ = drawn.draw(rows(len(x)))
    assert buckets(x, positions, edges, inclusive=inclusive).tolist() == \
        buckets_reference(x, positions, edges, inclusive=inclusive).tolist()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c", None, "d"]), max_size=200), st.data())
def test_text_cells_and_values_are_the_lookup_and_distinct(texts, drawn):
    """From the codes read through the positions: the cells ``Turns.lookup`` gives and the values
    ``Turns.distinct`` gives (values no turn holds left out, NULL as None)."""
    codes = np.array([-1 if t is None else "abcd".index(t) for t in texts], dtype=np.int32)
    turns = Turns({"t_wall": np.arange(len(texts), dtype=float)}, codes={"label": (codes, ("a", "b", "c", "d", "e"))})
    positions, *_ = drawn.draw(rows(len(texts)))
    view = turns if positions is None else turns.select(positions)
    table = drawn.draw(st.dictionaries(st.sampled_from(["a", "b", "c", "e", None]), st.integers(-1, 120)))
    default = drawn.draw(st.integers(-1, 5))
    assert text_cells(view, "label", table, default).tolist() == view.lookup("label", table, default).tolist()
    assert text_values(view, "label") == view.distinct("label")


def test_bad_input_is_refused():
    from specproxy.analyze import _cellsc
    x = np.arange(10, dtype=float)
    with pytest.raises(IndexError, match="outside"):
        _cellsc.finite_by_cell(x, np.array([0, 10], dtype=np.int64), None, 1, None, np.empty)
    with pytest.raises(IndexError, match="past ncell"):
        _cellsc.finite_by_cell(x, None, np.full(10, 3, dtype=np.int8), 3, None, np.empty)
    with pytest.raises(TypeError, match="float64"):
        _cellsc.finite_by_cell(x.astype(np.float32), None, None, 1, None, np.empty)
    with pytest.raises(TypeError, match="one per row"):
        _cellsc.finite_by_cell(x, None, np.zeros(9, dtype=np.int8), 1, None, np.empty)
    with pytest.raises(TypeError, match="int64"):
        _cellsc.finite_by_cell(x, np.array([1, 2], dtype=np.int32), None, 1, None, np.empty)
    with pytest.raises(IndexError, match="outside"):
        _cellsc.throughput_by_cell(x, x, x, np.array([-1], dtype=np.int64), None, 1, np.empty)
    with pytest.raises(ValueError, match="as long"):
        _cellsc.throughput_by_cell(x, x[:5], x, None, None, 1, np.empty)
    codes = np.array([0, 1, -1, 5], dtype=np.int32)
    with pytest.raises(IndexError, match="past the values"):
        _cellsc.codes_present(codes, None, 3)
    with pytest.raises(IndexError, match="past the values"):
        _cellsc.code_cells(codes, None, np.zeros(4, dtype=np.int8), np.empty(4, dtype=np.int8))
    with pytest.raises(TypeError, match="int8"):
        _cellsc.buckets(x, None, (1.0,), False, np.empty(10, dtype=np.int16))


def test_the_report_is_the_references_report(monkeypatch, data):
    """Every table and user figure through the C passes, then through the numpy references: the same JSON."""
    native = orjson.dumps(build_report(data, source="db"))
    report = orjson.loads(native)
    assert len(report["by_concurrency"]) > 2 and report["by_instance"] and report["by_prompt_length"]
    monkeypatch.setattr(by_cell, "_cellsc", None)
    assert orjson.dumps(build_report(data, source="db")) == native
