"""The PostgreSQL column cache (store/pg_cache.py) against a real PostgreSQL (tests/pgserver.py): whatever
happened to the database since the cache was written (a late turn in an old day, a deleted or updated
row, a dropped day, no turn_days at all), a load through the cache gives the columns the direct read
gives, value for value and in the same order; and it reads again only the days that changed. Issue 35.
"""

from __future__ import annotations

import json
import random
import uuid
from pathlib import Path

import numpy as np
import psycopg
import pytest
from click.testing import CliRunner

from specproxy.app.cli import main
from specproxy.store import pg_cache
from specproxy.store.column_cache import CACHED_TEXT
from specproxy.store.dataset import NUMERIC, TEXT
from specproxy.store.pg_source import PgSource
from specproxy.store.sinks import Identity
from specproxy.store.sinks.pg_retention import prune_postgres
from specproxy.store.sinks.postgres import DAY_S, PostgresSink
from specproxy.store.source import Window

T0 = 1_800_000_000.0 - 1_800_000_000.0 % DAY_S  # midnight UTC
DAYS = 4
COLUMNS = ("id", "t_wall", "path", "status", "outcome", "streamed", "label", "instance_id", "concurrency", "ttft_s",
           "decode_s", "total_s", "completion_tokens", "decode_tps", "prompt_tokens", "tokenizer", "content_class",
           "measured", "session", "client", "tool_names", "tenant", "proxy_name")
ALL = (*NUMERIC, *(c for c in CACHED_TEXT if c in TEXT))  # every turn column the cache holds


def turn_rows(rng: random.Random, n: int, day: int, proxy: str) -> list[tuple]:
    """Turns of one day: ties in t_wall, NULLs, unmeasured rows, and text a record's text form must quote
    (commas, quotes, parentheses, backslashes, an empty string)."""
    out = []
    t = T0 + day * DAY_S + 10.0
    for _ in range(n):
        t += 0.0 if rng.random() < 0.05 else rng.uniform(1.0, 300.0)
        out.append((uuid.uuid4().hex, min(t, T0 + (day + 1) * DAY_S - 1), "/v1/chat/completions", 200,
                    rng.choice(["ok", "ok", "client_abort"]), rng.choice([0, 1, None]), rng.choice(["a", "b", None]),
                    rng.choice(["i1", "i2"]), rng.randint(1, 9), rng.random(), rng.choice([rng.random(), None]),
                    rng.random() * 3, rng.randint(0, 900), rng.choice([None, rng.uniform(5, 90)]), rng.randint(1, 5000),
                    "tiktoken:o200k_base", rng.choice(["prose", "code", None]), rng.choice([1, 1, 1, 0, None]),
                    rng.choice(['s,1', 's"2', "(s3)", "back\\slash", "", None, "ünï"]),
                    rng.choice(["cli x", None]), rng.choice(['["a","b"]', None]), rng.choice(["t1", None]), proxy))
    return out


def send(url: str, rows: list[tuple], proxy: str = "edge-0") -> None:
    sink = PostgresSink(url)
    sink.open(Identity(proxy, f"store-{proxy}"))
    try:
        assert sink.send("turns", COLUMNS, rows) == []
    finally:
        sink.close()


def sql(url: str, *statements: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for s in statements:
            conn.execute(s)


@pytest.fixture
def fleet(pg_server, tmp_path, monkeypatch):
    """A fresh database of DAYS days of turns of two proxies, its cache in this test's own directory."""
    monkeypatch.setenv("SPECPROXY_CACHE_DIR", str(tmp_path / "cache"))
    url = pg_server.url(pg_server.new_database())
    rng = random.Random(3)
    for proxy in ("edge-0", "edge-1"):
        send(url, [r for day in range(DAYS) for r in turn_rows(rng, 150, day, proxy)], proxy)
    return url


def load(url: str, window: Window = Window(), columns=ALL, *, cache: bool):
    with PgSource(url, cache=cache) as pg:
        turns = pg.turns(window, columns)
        return turns, pg.unmeasured(window)


def assert_same(url: str, window: Window = Window(), columns=ALL, *, expect: str) -> None:
    """Through the cache (which did ``expect``) as read directly: every column, value, NULL and the order."""
    (got, unmeasured), status = load(url, window, columns, cache=True), pg_cache.last_status
    want, direct = load(url, window, columns, cache=False)
    assert status == expect
    assert len(got) == len(want) and set(got.num) == set(want.num) and set(got.txt) == set(want.txt)
    for k in want.num:
        assert got.num[k].dtype == want.num[k].dtype and np.array_equal(got.num[k], want.num[k], equal_nan=True), k
    for k in want.txt:
        assert got.txt[k].tolist() == want.txt[k].tolist(), k
    assert unmeasured == direct


def segments(tmp_path: Path) -> list[Path]:
    return [p for d in (tmp_path / "cache").iterdir() for p in d.iterdir() if p.name.startswith("seg-")]


def cached_days(tmp_path: Path) -> list[list[int]]:
    """The days each segment of the manifest holds."""
    (cdir,) = (tmp_path / "cache").iterdir()
    manifest = json.loads((cdir / "manifest.json").read_text())["tables"]["turns"]
    return [[int(p["check"]["day"] - T0 // DAY_S) for p in s["days"]] for s in manifest["segments"]]


def mapped(url: str) -> bool:
    """Whether a whole load's columns are the segment files mapped read-only (no copy) rather than arrays
    made by concatenating segments."""
    with PgSource(url) as pg:
        found = pg_cache.load_columns(pg.conn, ("t_wall", "total_s"), ("outcome",))
    assert pg_cache.last_status == "hit"
    return not any(a.flags.writeable for a in (found.rowid, *found.num.values(), found.codes["outcome"][0]))


def test_cold_build_then_warm_hit(fleet, tmp_path):
    assert_same(fleet, expect="build")
    assert cached_days(tmp_path) == [list(range(DAYS))] and len(segments(tmp_path)) == 1  # one segment of every day
    assert_same(fleet, expect="hit")
    assert mapped(fleet)
    assert_same(fleet, Window("a"), expect="hit")
    assert_same(fleet, columns=("t_wall", "outcome", "session"), expect="hit")
    full = load(fleet, cache=True)[0]
    assert len(full) > 500 and "" in full.txt["session"].tolist() and None in full.txt["session"].tolist()


def test_a_late_turn_in_an_old_day_reads_that_day_again(fleet):
    assert_same(fleet, expect="build")
    # shipped late, by another proxy, into day 1: its seq is above every cached one, its day an old one
    send(fleet, turn_rows(random.Random(8), 1, 1, "edge-2"), "edge-2")
    assert_same(fleet, expect=f"update (1 of {DAYS} days read)")
    assert_same(fleet, expect="hit")


@pytest.mark.parametrize("cache", [True, False])
def test_reads_inside_consistent_share_one_snapshot(fleet, cache):
    """The live page's and ``report --html``'s picture is a load and a read of the newest turns: inside
    ``consistent()`` a turn shipped between them is seen by neither (through the cache too, whose own
    transaction nests inside), and by both after it."""
    window = Window(since=T0)
    with PgSource(fleet, cache=cache) as pg:
        with pg.consistent():
            n = len(pg.load(window).turns)
            assert len(pg.recent(window, ("id",), 10**6)) == n
            # into a day that has its partition: a new one would wait for this transaction's lock
            (row,) = turn_rows(random.Random(11), 1, DAYS - 1, "edge-3")
            send(fleet, [(*row[:COLUMNS.index("measured")], 1, *row[COLUMNS.index("measured") + 1:])], "edge-3")
            assert len(pg.recent(window, ("id",), 10**6)) == n and len(pg.load(window).turns) == n
        assert len(pg.recent(window, ("id",), 10**6)) == n + 1 and len(pg.load(window).turns) == n + 1


def test_a_deleted_or_updated_row_reads_its_day_again(fleet):
    assert_same(fleet, expect="build")
    sql(fleet, f"DELETE FROM turns WHERE id = (SELECT id FROM turns WHERE t_wall < {T0 + DAY_S} LIMIT 1)")
    assert_same(fleet, expect=f"update (1 of {DAYS} days read)")
    sql(fleet, f"UPDATE turns SET outcome = 'x,y' WHERE t_wall >= {T0 + 2 * DAY_S} AND t_wall < {T0 + 2.5 * DAY_S}")
    assert_same(fleet, expect=f"update (1 of {DAYS} days read)")
    assert_same(fleet, expect="hit")


def test_a_dropped_day_loses_its_segment(fleet, tmp_path):
    assert_same(fleet, expect="build")
    done = prune_postgres(fleet, T0 + DAY_S + 3600, turns=True)  # day 0 dropped whole, an hour of day 1 deleted
    assert done["partitions"] == 1 and done["turns"] > 300
    assert_same(fleet, expect=f"update (1 of {DAYS - 1} days read)")
    assert cached_days(tmp_path) == [[2, 3], [1]] and len(segments(tmp_path)) == 2
    assert_same(fleet, expect="hit")
    assert prune_postgres(fleet, T0 + 2 * DAY_S, turns=True)["partitions"] == 1  # a day dropped, no row deleted
    assert_same(fleet, expect="hit")
    assert cached_days(tmp_path) == [[2, 3]] and len(segments(tmp_path)) == 1


def test_changed_days_get_segments_of_their_own_until_there_are_too_many(fleet, tmp_path, monkeypatch):
    monkeypatch.setattr(pg_cache, "MAX_SEGMENTS", 2)
    assert_same(fleet, expect="build")
    send(fleet, turn_rows(random.Random(10), 2, 0, "edge-0"))
    assert_same(fleet, expect=f"update (1 of {DAYS} days read)")
    assert cached_days(tmp_path) == [[1, 2, 3], [0]]
    assert not mapped(fleet)  # two segments: the columns are copied into one array each
    send(fleet, turn_rows(random.Random(11), 2, 2, "edge-0"))
    assert_same(fleet, expect=f"update (1 of {DAYS} days read)")
    assert cached_days(tmp_path) == [list(range(DAYS))] and len(segments(tmp_path)) == 1  # three: one again
    assert_same(fleet, expect="hit")
    assert mapped(fleet)


def test_a_window_reads_only_its_days(fleet):
    assert_same(fleet, expect="build")
    send(fleet, turn_rows(random.Random(9), 3, 3, "edge-0"))  # day 3 changes
    # windows inside days 0-2: served from their segments, day 3 not read
    for w in (Window(since=T0, until=T0 + DAY_S), Window("b", T0 + 3600, T0 + 7200),
              Window(since=T0 + 0.5 * DAY_S, until=T0 + 2.5 * DAY_S), Window(until=T0 + 2 * DAY_S)):
        assert_same(fleet, w, expect="hit")
    # part of the changed day: the window from PostgreSQL, the day left for a window that holds it whole
    narrow = f"narrow: day {int(T0 // DAY_S) + 3} changed and the window holds part of it: read from PostgreSQL"
    assert_same(fleet, Window(since=T0 + 3 * DAY_S + 60), expect=narrow)
    assert_same(fleet, Window(since=T0 + 3 * DAY_S), expect="update (1 of 1 days read)")
    assert_same(fleet, Window(since=T0 + 3 * DAY_S + 60), expect="hit")
    assert_same(fleet, Window(since=T0 + 9 * DAY_S), expect="hit")  # no day: nothing


def test_a_database_without_turn_days_is_read_directly(fleet):
    sql(fleet, "DROP TABLE turn_days CASCADE")
    assert_same(fleet, expect="unusable: Invalid: no turn_days (migration 006_turn_days): a database no proxy of "
                              "this version has shipped to")


def test_an_unwritable_cache_directory_still_reads(fleet, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("SPECPROXY_CACHE_DIR", str(tmp_path / "file"))
    assert_same(fleet, expect="build (not saved)")
    assert_same(fleet, expect="build (not saved)")
    assert (tmp_path / "file").read_text() == "not a directory"


def report(*args: str) -> dict:
    out = CliRunner().invoke(main, ["report", "--json", *args])
    assert out.exit_code == 0, out.output
    return json.loads(out.output)


def test_report_through_the_cache_is_the_report_without_it(fleet, tmp_path):
    direct = report("--db", fleet, "--no-cache")
    assert not (tmp_path / "cache").exists()  # --no-cache: nothing written
    assert report("--db", fleet) == direct and pg_cache.last_status == "build"
    assert cached_days(tmp_path) == [list(range(DAYS))]
    assert report("--db", fleet) == direct and pg_cache.last_status == "hit"
    assert direct["turns"] > 500
    window = ("--since", str(T0 + 3600), "--until", str(T0 + 2 * DAY_S), "--label", "a")
    assert report("--db", fleet, *window) == report("--db", fleet, "--no-cache", *window)
