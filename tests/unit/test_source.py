"""The load path (store/source.py): what a store returns, and that loading a window's data once gives the
analysis every figure it gave when it queried the database itself.

The server section reads the scrapes between bounds it finds itself; ``Source.load`` hands it only the
scrapes around the window's turns. Held here against a store that hands it every scrape it holds, over
windows that cut the turns anywhere, with failed scrapes and gaps where the bounds fall.
"""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import numpy as np
import orjson
import pytest

from specproxy.analyze.report_data import REPORT_COLUMNS, build_report
from specproxy.app.fake_upstream import make_record
from specproxy.store import rows
from specproxy.store.dataset import NUMERIC, TEXT
from specproxy.store.source import SCRAPE_FIELDS, Scrapes, Window
from specproxy.store.sqlite_source import SQLiteSource
from specproxy.store.writer import Writer

T0 = 1_800_000_000.0


class EveryScrape(SQLiteSource):
    """The reference: every stored scrape, whatever the window."""

    def _server_scrapes(self, turns, until) -> Scrapes:
        return self.scrapes(-np.inf, np.inf)


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    """300 turns over ~40 minutes (labels, outcomes, NULLs, ties), lone-turn counters for some, and scrapes
    every ~5 s with failures, a run of failures and an hour-long gap in the middle."""
    path = tmp_path_factory.mktemp("source") / "s.db"
    rng = random.Random(5)
    w = Writer(path)
    for i in range(300):
        t = T0 + i * 8.0 + (rng.random() * 30 if rng.random() < 0.1 else 0.0)
        rec = make_record(seed=rng.random(), t_wall=t, label=rng.choice(["a", "b", None]),
                          instance_id=rng.choice(["i1", "i2"]), concurrency=rng.choice([1, 1, 2, 5]),
                          outcome="ok" if rng.random() > 0.1 else "client_abort",
                          decode_tps=rng.uniform(20, 90) if rng.random() > 0.05 else None)
        w.put(rec)
        if rng.random() < 0.05:  # another path's row: forwarded, recorded, never a figure
            w.put(make_record(seed=rng.random(), t_wall=t + 1.0, label=rec.label, path="/v1/models",
                              measured=False))
        if rec.concurrency == 1 and rng.random() < 0.6:
            w.put(rows.turn_counters(rec.id, rec.instance_id, 1.0, 100.0, 40.0, 80.0, 60.0,
                                     rng.choice([2.5, 1.8, None]), 0.75))
    t, tokens = T0 - 60.0, 0.0
    while t < T0 + 2500.0:
        if T0 + 900 < t < T0 + 1300:  # no scrape at all here
            t += 5.0
            continue
        if rng.random() < 0.15 or T0 + 1600 < t < T0 + 1700:
            w.put(rows.failed_scrape(t, t - T0, "i1", "connection refused"))
        else:
            tokens += rng.randint(100, 900)
            w.put(rows.scrape((t, t - T0, rng.choice(["i1", "i2"]), "llamacpp", float(rng.randint(0, 5)), 0.0,
                               tokens, tokens * 3, tokens / 3, tokens / 1.5, tokens / 2, None, None, "[]", None),
                               latency_s=rng.choice([None, 0.01, rng.uniform(0.5, 6.0)])))
        t += rng.uniform(2.0, 8.0)
    w.close()
    return path


def windows() -> list[Window]:
    rng = random.Random(9)
    out = [Window(), Window("a"), Window("nobody"), Window(since=T0 + 1000), Window(until=T0 + 1000),
           Window(since=T0 + 5000)]
    for _ in range(25):
        lo = T0 + rng.uniform(-100, 2500)
        out.append(Window(rng.choice([None, "a", "b"]), lo, lo + rng.choice([30.0, 300.0, 1500.0])))
    return out


@pytest.mark.parametrize("window", windows(), ids=str)
def test_the_loaded_window_gives_the_report_every_scrape_gives(db, window):
    with SQLiteSource(db) as store, EveryScrape(db) as every:
        got = build_report(store.load(window, REPORT_COLUMNS, server=True, context=True), source="s")
        want = build_report(every.load(window, REPORT_COLUMNS, server=True, context=True), source="s")
    assert orjson.dumps(got, option=orjson.OPT_SERIALIZE_NUMPY) == orjson.dumps(want, option=orjson.OPT_SERIALIZE_NUMPY)


def test_a_window_loads_fewer_scrapes_than_the_store_holds(db):
    """The point of the bounds: a window of a few minutes does not read the whole scrape table."""
    with SQLiteSource(db) as store:
        short = store.load(Window(since=T0 + 300, until=T0 + 420), REPORT_COLUMNS, server=True)
        held = len(store.scrapes(-np.inf, np.inf))
        start = short.turns.num["t_wall"]
        during = store.scrapes(start.min(), min(np.max(start + short.turns.num["total_s"]), T0 + 420))
    assert 0 < len(short.scrapes) < held / 10
    # yet it holds the scrape before the turns and every one taken while they ran
    assert short.scrapes.t_wall.min() <= start.min() and len(during) > 0
    assert set(during.t_wall.tolist()) <= set(short.scrapes.t_wall.tolist())


def test_what_a_store_returns(db):
    """The contract fleet stores are written to: dtypes, NULL as nan/None, order, filters in the query."""
    with SQLiteSource(db) as store:
        every = store.turns(Window())
        some = store.turns(Window("a", T0 + 100, T0 + 1500), ("ttft_s", "label"))
        lone = store.lone_joins(Window("a", T0 + 100, T0 + 1500))
        lone_all = store.lone_joins(Window())
        summary = store.database()
    assert every.num["rowid"].dtype == np.int64
    assert all(every.num[c].dtype == np.float64 for c in NUMERIC if c in every.num)
    assert all(every.txt[c].dtype == object for c in TEXT if c in every.txt)
    assert np.isnan(every.num["decode_tps"]).any()  # NULL is nan, never 0
    t = every.num["t_wall"]
    assert np.all((t[1:] > t[:-1]) | ((t[1:] == t[:-1]) & (every.num["rowid"][1:] > every.num["rowid"][:-1])))
    assert set(some.num) == {"rowid", "t_wall", "ttft_s"} and set(some.txt) == {"label"}
    assert set(some.txt["label"].tolist()) == {"a"}
    assert some.num["t_wall"].min() >= T0 + 100 and some.num["t_wall"].max() < T0 + 1500
    assert lone.rowid.dtype == np.int64 and 0 < len(lone.rowid) < len(lone_all.rowid)
    assert set(lone.rowid.tolist()) <= set(some.num["rowid"].tolist())
    assert summary["n"] == len(every) and summary["labels"] == ["a", "b"]


def test_a_narrow_window_is_read_by_its_index_not_from_the_whole_cache(db):
    """The columnar cache holds every turn: the last hour of a month must not load the month. A window
    holding under 1/NARROW of the rows is read from SQLite through the t_wall index; the same columns."""
    from specproxy.store import column_cache

    wide, narrow = Window(since=T0 + 100), Window(since=T0 + 300, until=T0 + 420)
    with SQLiteSource(db, cache=True) as cached, SQLiteSource(db) as plain:
        cached.turns(Window())  # builds the cache
        column_cache.last_status = None
        got = cached.turns(narrow, REPORT_COLUMNS)
        assert column_cache.last_status is None  # the cache was not read
        want = plain.turns(narrow, REPORT_COLUMNS)
        cached.turns(wide, REPORT_COLUMNS)
        assert column_cache.last_status in ("hit", "append", "build")  # a wide window is read from the cache
    assert 0 < len(got) and got.num.keys() == want.num.keys()
    assert all(np.array_equal(got.num[k], want.num[k], equal_nan=True) for k in got.num)
    assert all(got.txt[k].tolist() == want.txt[k].tolist() for k in got.txt)


@pytest.mark.parametrize("window", windows()[:12], ids=str)
def test_other_paths_counted_from_the_cached_columns_as_sql_counts_them(db, window):
    """Served from the cache, the window's other-path rows are counted from its columns (not read again)."""
    with SQLiteSource(db, cache=True) as cached, SQLiteSource(db) as plain:
        got = cached.load(window, REPORT_COLUMNS, context=True).unmeasured
        want = plain.load(window, REPORT_COLUMNS, context=True).unmeasured
    assert got == want
    assert windows()[0] != window or want > 0


def test_the_whole_database_summary_equals_plain_scans(tmp_path):
    """``database()`` (read on every picture of an idle live page) seeks indexes instead of scanning:
    it says what plain scans of the table say, labels of measured rows only, a row from before
    ``measured`` (NULL) counted as measured, as every reader of turns counts it."""
    path = tmp_path / "w.db"
    w = Writer(path)
    for i, (label, measured) in enumerate([("a", True), ("b", True), ("only-other", False), (None, True),
                                           ("a", True), ("c", None), ("b", False)]):
        w.put(make_record(seed=i, t_wall=T0 + i, label=label, measured=measured is not False))
    w.close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE turns SET measured = NULL WHERE label = 'c'")  # a row written before `measured`
    conn.commit()
    with SQLiteSource(conn) as store:
        got = store.database()
    n, first, last = conn.execute("SELECT count(*), min(t_wall), max(t_wall) FROM turns WHERE measured IS NOT 0").fetchone()
    other = conn.execute("SELECT count(*) FROM turns WHERE measured = 0").fetchone()[0]
    labels = sorted(r[0] for r in conn.execute(
        "SELECT DISTINCT label FROM turns WHERE measured IS NOT 0 AND label IS NOT NULL"))
    conn.close()
    assert got == {"n": n, "first_t_wall": first, "last_t_wall": last, "other": other, "labels": labels}
    assert labels == ["a", "b", "c"] and other == 2


def test_scrapes_from_rows_as_columns_one_by_one():
    """``Scrapes.from_rows`` casts one 2-D array; the same columns built one by one, None as nan."""
    rows = [(T0, "i1", "llamacpp", None, 1.0, None, 10.0, 30.0, None, None, None, None, None, 40.0, 10.0, 0.004),
            (T0 + 5, None, None, "refused", None, None, None, None, None, None, None, None, None, None, None, None),
            (T0 + 9, "i2", "sglang", None, 2.0, 0.0, 20.0, 60.0, 3.0, 6.0, 1.5, 2.5, 0.4, None, None, 0.02)]
    assert all(len(r) == 4 + len(SCRAPE_FIELDS) for r in rows)
    got = Scrapes.from_rows(rows)
    cols = list(zip(*rows))
    assert np.array_equal(got.t_wall, np.array(cols[0], dtype=float))
    for i, name in enumerate(("instance_id", "server_kind", "error")):
        assert getattr(got, name).tolist() == list(cols[1 + i])
    for i, f in enumerate(SCRAPE_FIELDS):
        assert np.array_equal(got.num[f], np.array(cols[4 + i], dtype=float), equal_nan=True)
        assert got.num[f].dtype == np.float64 and got.num[f].flags.c_contiguous


def assert_scrapes_equal(got: Scrapes, want: Scrapes) -> None:
    """Row for row, in order: times, text (None for NULL), every figure (nan for NULL), the dtypes."""
    assert got.t_wall.dtype == want.t_wall.dtype == np.float64
    assert np.array_equal(got.t_wall, want.t_wall)
    for name in ("instance_id", "server_kind", "error"):
        assert getattr(got, name).dtype == object and getattr(got, name).tolist() == getattr(want, name).tolist(), name
    assert got.num.keys() == want.num.keys()
    for f in SCRAPE_FIELDS:
        assert got.num[f].dtype == np.float64 and got.num[f].flags.c_contiguous, f
        assert np.array_equal(got.num[f], want.num[f], equal_nan=True), f


def spans(t: np.ndarray, seed: int) -> list[tuple[float, float]]:
    """Everything, nothing, and spans whose bounds fall on stored scrape times (both ends inclusive)."""
    rng = random.Random(seed)
    out = [(-np.inf, np.inf), (T0 + 10_000, T0 + 20_000), (T0 + 900, T0 + 1300)]
    for _ in range(12):
        a, b = sorted(rng.sample(t[~np.isnan(t)].tolist(), 2))
        out.append((a, b))
    return out


def test_scrapes_from_the_cache_are_the_sql_scrapes(db):
    """``scrapes(t0, t1)`` served from the columnar cache: the rows ``queries.scrape_rows`` gives, in its
    order, with failed scrapes, gaps and bounds on stored times."""
    from specproxy.store import column_cache

    with SQLiteSource(db, cache=True) as cached, SQLiteSource(db) as plain:
        every = plain.scrapes(-np.inf, np.inf)
        for t0, t1 in spans(every.t_wall, 3):
            assert_scrapes_equal(cached.scrapes(t0, t1), plain.scrapes(t0, t1))
            assert column_cache.last_rows_status in ("build", "hit"), column_cache.last_rows_status
    assert column_cache.last_rows_status == "hit"


def test_cached_scrapes_follow_appends_deletions_ties_and_nulls(tmp_path):
    """Scrapes inserted out of time order, equal times (SQL orders ties by rowid, through its t_wall
    index), a NULL time (never in a span), appended later, then deleted by retention and edited."""
    from specproxy.store import column_cache
    from specproxy.store.db import connect
    from specproxy.store.retention import delete_scrapes

    path = tmp_path / "ties.db"
    rng = random.Random(11)

    def put(n: int, base: float) -> None:
        w = Writer(path)
        for i in range(n):
            t = None if i == 5 else base + rng.choice([0.0, 1.0, 1.0, 2.5]) + (i // 4) * 3.0
            if rng.random() < 0.2:
                w.put(rows.failed_scrape(t, float(i), rng.choice(["i1", None]), rng.choice(["refused", "timeout"])))
            else:
                w.put(rows.scrape((t, float(i), rng.choice(["i1", "i2"]), "vllm", float(i), None, float(i * 10),
                                   None, 1.0, 2.0, float(i), 1.5, 0.5, "[]", None), prefix_cache_hits=float(i)))
        w.close()

    def check(expect: str) -> None:
        with SQLiteSource(path, cache=True) as cached, SQLiteSource(path) as plain:
            every = plain.scrapes(-np.inf, np.inf)
            status = None
            for t0, t1 in spans(every.t_wall, len(every)):
                assert_scrapes_equal(cached.scrapes(t0, t1), plain.scrapes(t0, t1))
                status = status or column_cache.last_rows_status
        assert status == expect

    put(200, T0)
    check("build")
    check("hit")
    put(60, T0 + 100)  # overlapping times, new rowids
    check("append")
    conn = connect(path)
    assert delete_scrapes(conn, T0 + 30) > 0  # retention: the oldest scrapes deleted
    conn.close()
    check("build")
    conn = sqlite3.connect(path)
    conn.execute("UPDATE scrapes SET requests_running = 99 WHERE id = 150")
    conn.commit()
    conn.close()
    check("build")
    check("hit")


def test_reads_inside_consistent_share_one_committed_state(tmp_path):
    """The live page draws its figures (``load``) and its newest turns (``recent``) in two reads; a turn
    committed between them once showed in the list and not in the count. Inside ``consistent()`` a
    commit made by another connection after the first read is seen by neither read; after it, by both."""
    path = tmp_path / "c.db"
    w = Writer(path)
    for i in range(3):
        w.put(make_record(seed=i, t_wall=T0 + i))
    w.close()
    with SQLiteSource(path) as store:
        with store.consistent():
            assert len(store.load(Window()).turns) == 3
            other = Writer(path)
            other.put(make_record(seed=9, t_wall=T0 + 9))
            other.close()  # committed
            assert len(store.recent(Window(), ("id",), 10)) == 3
            assert store.nth_newest_t_wall(Window(), 1) == T0 + 2
        assert len(store.recent(Window(), ("id",), 10)) == 4 and len(store.load(Window()).turns) == 4
