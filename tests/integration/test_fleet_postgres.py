"""The fleet's write side against a real PostgreSQL (tests/pgserver.py): the shipper reads the local
database forward and ships turns, scrapes and counter joins; 0 lost and 0 duplicated through a sink that
goes down and comes back, a proxy SIGKILLed mid-batch, rows the sink already holds; a refused row set
aside with its reason while the rest of its batch goes in; wrong credentials, an unreachable host and
missing permissions said in one line while the proxy forwards and records; two proxies under one
``proxy_name`` refused, never merged. Issue 35. Every wait is for an event (the shipper's
``caught_up``, a row count, a log line), bounded.
"""

from __future__ import annotations

import hashlib
import signal
import sqlite3
import time
import urllib.request
from pathlib import Path

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from faultkit import wait_until
from pgcluster import LOCKED_PASSWORD
from pgserver import pg_count
from serveproc import LoopThread, ServeProcess, chat
from specproxy.app.fake_upstream import FakeUpstream, Script
from specproxy.record import FIELD_NAMES, Record, new_turn_id
from specproxy.store import rows as store_rows
from specproxy.store.shipper import Shipper
from specproxy.store.sinks import Identity, SinkError
from specproxy.store.sinks.pg_migrations import PG_MIGRATIONS
from specproxy.store.sinks.postgres import PostgresSink
from specproxy.store.writer import Writer

CHAT = "/v1/chat/completions"


def record(i: int, **over) -> Record:
    fields = dict(id=new_turn_id(), t_wall=time.time() - 1000 + i * 0.01, method="POST", path=CHAT, status=200,
                  outcome="ok", streamed=True, model="m", label="a" if i % 2 else "b", concurrency=1 + i % 4,
                  ttft_s=0.1 + i * 1e-4, decode_s=0.5, total_s=0.6, completion_tokens=50 + i % 7,
                  decode_tps=100.0 + i, request_parsed=True, saw_done=True, measured=True)
    fields.update(over)
    return Record(**fields)


def write(db: Path, records, items=()) -> None:
    w = Writer(db, queue_size=100_000)
    for r in records:
        assert w.put(r)
    for item in items:
        assert w.put(item)
    w.close()
    assert w.written == len(records)


def pg_rows(pg, db: str, sql: str) -> list[tuple]:
    with psycopg.connect(pg.url(db), autocommit=True) as conn:
        return conn.execute(sql).fetchall()


def local_turns(db: Path) -> dict[str, tuple]:
    conn = sqlite3.connect(db)
    try:
        return {row[0]: row for row in conn.execute(f"SELECT {', '.join(FIELD_NAMES)} FROM turns")}
    finally:
        conn.close()


def remote_turns(pg, db: str) -> dict[str, tuple]:
    rows = pg_rows(pg, db, f"SELECT {', '.join(FIELD_NAMES)} FROM turns")
    out = {row[0]: row for row in rows}
    assert len(out) == len(rows), "a turn held twice"
    return out


def ship(db: Path, url: str, name: str = "proxy-a", **kwargs) -> Shipper:
    shipper = Shipper(db, PostgresSink(url), name, idle_s=0.05, max_wait_s=0.5, **kwargs)
    shipper.start()
    return shipper


def caught_up(shipper: Shipper, timeout: float = 60) -> None:
    assert shipper.caught_up.wait(timeout), f"the shipper did not catch up: {shipper.last_error}"


@pytest.fixture
def pgdb(pg_server):
    return pg_server.new_database()


def test_released_pg_migrations_never_change():
    """A released migration never changes (every proxy of a fleet must build the same schema): a change
    is a new one, appended."""
    released = {"001_fleet": "8acdeb1127872aa6", "002_counters_seq": "64aa86ad1164a91f", "003_tenant": "55218d5ec99c503c",
                "004_prefix_cache": "6f57f2698fa41e2d", "005_prompt_block_digests": "c8d685db1b79872c",
                "006_turn_days": "76145b8d2dc7b233", "007_scrape_latency": "0cf9c828bc265323"}
    hashes = {name: hashlib.sha256("\n;\n".join(s).encode()).hexdigest()[:16] for name, s in PG_MIGRATIONS}
    assert list(hashes)[:len(released)] == list(released), "a new PostgreSQL migration goes last"
    assert {name: hashes[name] for name in released} == released


def test_pg_turns_table_is_the_record(pg_server, pgdb):
    """Every Record field is a column of PostgreSQL's turns (the shipper sends them all), none left over."""
    sink = PostgresSink(pg_server.url(pgdb))
    sink.open(Identity("p", "s1"))
    sink.close()
    columns = [r[0] for r in pg_rows(pg_server, pgdb, "SELECT column_name FROM information_schema.columns WHERE "
                                     "table_name = 'turns' ORDER BY ordinal_position")]
    assert set(columns) == {*FIELD_NAMES, "seq"}  # seq: the order the database took them (store/source.py)
    # migrating again (another proxy of the fleet starting) changes nothing
    sink.open(Identity("p", "s1"))
    sink.close()
    assert pg_rows(pg_server, pgdb, "SELECT count(*) FROM specproxy_migrations") == [(len(PG_MIGRATIONS),)]


def test_ships_every_turn_scrape_and_counter_once(tmp_path, pg_server, pgdb):
    db = tmp_path / "a.db"
    records = [record(i) for i in range(12_000)]
    scrape = store_rows.scrape((time.time(), 1.0, "inst", "llamacpp", *([1.0] * 9), "raw page", None))
    counters = store_rows.turn_counters(records[0].id, "inst", 0.5, 10, 2, 8, 6, 2.5, 0.75)
    write(db, records, [scrape, counters])
    shipper = ship(db, pg_server.url(pgdb), batch=5000)
    try:
        caught_up(shipper)
    finally:
        shipper.close()
    assert remote_turns(pg_server, pgdb) == {k: v[:-1] + ("proxy-a",) for k, v in local_turns(db).items()}
    assert shipper.rows_shipped == 12_002 and shipper.rows_behind == 0 and shipper.seconds_behind == 0
    assert pg_rows(pg_server, pgdb, "SELECT proxy_name, instance_id, raw FROM scrapes") == [("proxy-a", "inst", "raw page")]
    assert pg_rows(pg_server, pgdb, "SELECT turn_id, mal FROM turn_counters") == [(records[0].id, 2.5)]
    # one partition per day the turns fall in
    days = {int(r.t_wall // 86400) for r in records}
    assert len(pg_rows(pg_server, pgdb, "SELECT inhrelid FROM pg_inherits WHERE inhparent = 'turns'::regclass")) == len(days)
    # a second run on the same file sends nothing again: its progress is in the file
    shipper = ship(db, pg_server.url(pgdb))
    try:
        caught_up(shipper)
    finally:
        shipper.close()
    assert shipper.rows_shipped == 0 and len(remote_turns(pg_server, pgdb)) == 12_000


def test_rows_already_held_are_ignored(tmp_path, pg_server, pgdb):
    """A batch sent again (the proxy died after the sink's commit, before noting it) adds nothing."""
    db = tmp_path / "a.db"
    write(db, [record(i) for i in range(300)])
    shipper = ship(db, pg_server.url(pgdb))
    caught_up(shipper)
    shipper.close()
    conn = sqlite3.connect(db)
    conn.execute("DELETE FROM sink_progress")  # as if no batch had been noted
    conn.commit()
    conn.close()
    write(db, [record(i) for i in range(300, 350)])
    shipper = ship(db, pg_server.url(pgdb))
    try:
        caught_up(shipper)
    finally:
        shipper.close()
    assert len(remote_turns(pg_server, pgdb)) == 350 == len(local_turns(db))


def test_a_new_batch_goes_straight_in_and_one_sent_again_the_careful_way(tmp_path, pg_server, pgdb):
    """A fresh batch is COPYed straight into the table (no staging table is made: the fast way); a batch
    holding rows already held fails that COPY, takes nothing from it, and goes through the staging table's
    ON CONFLICT DO NOTHING: the new rows in, the old ones once."""
    url = pg_server.url(pgdb)
    rows = [tuple(int(v) if isinstance(v, bool) else v for v in (getattr(record(i, proxy_name="proxy-a"), f)
                                                                  for f in FIELD_NAMES))
            for i in range(40)]  # as SQLite gives them (booleans 0/1)
    staging = "SELECT count(*) FROM pg_class WHERE relname = 'stage_turns' AND relpersistence = 't'"
    sink = PostgresSink(url)
    sink.open(Identity("proxy-a", "store-a"))
    try:
        assert sink.send("turns", FIELD_NAMES, rows[:30]) == []
        assert pg_rows(pg_server, pgdb, staging) == [(0,)]  # straight in
        assert sink.send("turns", FIELD_NAMES, rows[20:]) == []  # 10 held already, 10 new
        assert pg_rows(pg_server, pgdb, staging) == [(1,)]  # the careful way, on this connection
    finally:
        sink.close()
    held = remote_turns(pg_server, pgdb)
    assert sorted(held) == sorted(row[0] for row in rows)
    assert all(held[row[0]][1] == row[1] for row in rows)


def test_a_refused_row_is_set_aside_and_the_rest_go_in(tmp_path, pg_server, pgdb):
    db = tmp_path / "a.db"
    bad = record(5, concurrency=2**40)  # SQLite holds it; PostgreSQL's INTEGER cannot
    good = [record(i) for i in range(200)]
    write(db, [*good[:100], bad, *good[100:]])
    shipper = ship(db, pg_server.url(pgdb))
    try:
        caught_up(shipper)
    finally:
        shipper.close()
    held = remote_turns(pg_server, pgdb)
    assert set(held) == {r.id for r in good}
    assert shipper.rows_set_aside == 1 and shipper.rows_shipped == 200
    conn = sqlite3.connect(db)
    aside = conn.execute("SELECT tbl, row_key, reason FROM sink_refused").fetchall()
    conn.close()
    assert len(aside) == 1 and aside[0][:2] == ("turns", bad.id)
    assert "out of range" in aside[0][2]


def test_postgres_down_then_back_loses_and_duplicates_nothing(tmp_path, pg_server):
    db_name = pg_server.new_database()
    db = tmp_path / "a.db"
    w = Writer(db, queue_size=100_000)
    first = [record(i) for i in range(500)]
    for r in first:
        w.put(r)
    shipper = ship(db, pg_server.url(db_name))
    try:
        wait_until(lambda: shipper.caught_up.is_set() and shipper.rows_shipped == 500, 60, 0.02, "first ship")
        pg_server.stop("fast")
        try:
            later = [record(i) for i in range(500, 2500)]
            for r in later:  # the writer keeps committing locally while the sink is down
                assert w.put(r)
            wait_until(lambda: shipper.last_error is not None and shipper.rows_behind == 2000, 60, 0.02,
                       "the outbox to grow and the failure to be seen")
            assert shipper.batches_failed >= 1 and shipper.seconds_behind > 0
        finally:
            pg_server.start()
        shipper.caught_up.clear()
        wait_until(lambda: shipper.caught_up.is_set() and shipper.rows_behind == 0, 60, 0.02, "the catch-up")
        assert shipper.last_error is None
    finally:
        shipper.close()
        w.close()
    assert set(remote_turns(pg_server, db_name)) == set(local_turns(db)) and len(local_turns(db)) == 2500


def test_two_proxies_under_one_name_are_refused_never_merged(tmp_path, pg_server, pgdb):
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    write(a, [record(i) for i in range(10)])
    write(b, [record(i) for i in range(10)])
    first = ship(a, pg_server.url(pgdb), name="same")
    try:
        caught_up(first)
    finally:
        first.close()
    second = ship(b, pg_server.url(pgdb), name="same")
    try:
        wait_until(lambda: second.last_error is not None, 30, 0.02, "the clash")
    finally:
        second.close()
    assert "'same' already ships here from another proxy's database" in second.last_error
    assert set(remote_turns(pg_server, pgdb)) == set(local_turns(a))
    other = ship(b, pg_server.url(pgdb), name="other")  # renamed: ships
    try:
        caught_up(other)
    finally:
        other.close()
    assert len(remote_turns(pg_server, pgdb)) == 20


def test_sink_errors_are_one_line(pg_server, pgdb, monkeypatch, refused):
    monkeypatch.setenv("PGPASSWORD", "wrong-" + LOCKED_PASSWORD)
    cases = {
        pg_server.url(pgdb, user="locked"): "password authentication failed",
        pg_server.url(pgdb, user="reader"): "permission denied",
        f"postgresql://fleet@127.0.0.1:{refused}/x": "cannot connect",
    }
    for url, why in cases.items():
        sink = PostgresSink(url)
        with pytest.raises(SinkError) as err:
            sink.open(Identity("p", "s"))
        assert why in str(err.value) and "\n" not in str(err.value)
    # the password libpq reads from the environment is the one that counts (never the URL's: refused)
    monkeypatch.setenv("PGPASSWORD", LOCKED_PASSWORD)
    pg_server.admin(f"GRANT CREATE ON SCHEMA public TO locked", db=pgdb)
    sink = PostgresSink(pg_server.url(pgdb, user="locked"))
    sink.open(Identity("p", "s"))
    sink.close()


@pytest.fixture
def upstream():
    lt = LoopThread()
    up = FakeUpstream(Script(pieces=["a", "b", "c"]))
    lt.run(up.start())
    yield up
    lt.run(up.close())
    lt.close()


@pytest.mark.parametrize("who", ["locked", "reader", "unreachable"])
def test_serve_with_a_failing_sink_forwards_records_and_says_why(tmp_path, pg_server, pgdb, upstream, who, refused):
    url = (f"postgresql://fleet@127.0.0.1:{refused}/x" if who == "unreachable"
           else pg_server.url(pgdb, user=who))
    canary = "canary-pw-" + new_turn_id()
    db = tmp_path / "s.db"
    proc = ServeProcess(tmp_path, upstream.url, db, "--sink", url, "--proxy-name", "edge-1",
                        env={"PGPASSWORD": canary})
    try:
        for _ in range(3):
            assert chat(proc.url) == 200
        wait_until(lambda: len(local_turns(db)) == 3, 30, 0.02, "the turns recorded locally")
        why = {"locked": "password authentication failed", "reader": "permission denied",
               "unreachable": "cannot connect"}[who]
        wait_until(lambda: why in proc.stderr(), 30, 0.05, "the sink's line")
        lines = [ln for ln in proc.stderr().splitlines() if why in ln]
        assert len(lines) == 1, lines  # once per cause, however often it is retried
        page = urllib.request.urlopen(proc.url + "/_specproxy/", timeout=30).read().decode()
        assert why in page
        # the shipper's figures on /_specproxy/metrics: the three turns wait, batches failed
        def read_metrics() -> dict[str, float]:
            page = urllib.request.urlopen(proc.url + "/_specproxy/metrics", timeout=30).read().decode()
            return {s.name: s.value for f in text_string_to_metric_families(page) for s in f.samples}

        # (the shipper counts what waits after each attempt: the last turns are counted by the next)
        wait_until(lambda: read_metrics()["specproxy_sink_rows_behind"] == 3, 30, 0.1, "the outbox counted")
        metrics = read_metrics()
        assert metrics["specproxy_sink_rows_behind"] == 3 and metrics["specproxy_sink_rows_shipped_total"] == 0
        assert metrics["specproxy_sink_batches_failed_total"] >= 1 and metrics["specproxy_sink_seconds_behind"] > 0
    finally:
        proc.signal(signal.SIGTERM)
        proc.wait(60)
    assert {v[-1] for v in local_turns(db).values()} == {"edge-1"}
    for path in (db, Path(f"{db}-wal"), proc.log_path):
        if path.exists():
            assert canary.encode() not in path.read_bytes()


def test_sigkill_mid_batch_then_restart_loses_and_duplicates_nothing(tmp_path, pg_server, pgdb, upstream):
    """The sink's INSERT held by a lock PostgreSQL-side when the proxy is SIGKILLed: that batch never
    committed; the restarted proxy sends it again, with what came since, once."""
    db = tmp_path / "s.db"
    url = pg_server.url(pgdb)
    proc = ServeProcess(tmp_path, upstream.url, db, "--sink", url, "--proxy-name", "edge-1")
    try:
        chat(proc.url)
        wait_until(lambda: pg_count(pg_server.url(pgdb)) == 1, 60, 0.05, "first turn shipped")
        with psycopg.connect(pg_server.url(pgdb)) as locker:
            locker.execute("LOCK TABLE turns IN ACCESS EXCLUSIVE MODE")
            for _ in range(20):
                chat(proc.url)
            wait_until(lambda: len(local_turns(db)) == 21, 30, 0.02, "the turns committed locally")
            wait_until(lambda: pg_rows(pg_server, pgdb, "SELECT count(*) FROM pg_locks WHERE NOT granted") != [(0,)],
                       60, 0.05, "the shipper's batch to wait on the lock")
            proc.signal(signal.SIGKILL)
            proc.wait(30)
            locker.rollback()
    finally:
        if proc.proc.poll() is None:
            proc.signal(signal.SIGKILL)
            proc.wait(30)
    assert pg_rows(pg_server, pgdb, "SELECT count(*) FROM turns") == [(1,)]
    proc = ServeProcess(tmp_path, upstream.url, db, "--sink", url, "--proxy-name", "edge-1")
    try:
        for _ in range(5):
            chat(proc.url)
        wait_until(lambda: len(local_turns(db)) == 26, 30, 0.02, "the turns recorded")
        wait_until(lambda: pg_count(pg_server.url(pgdb)) == 26, 60, 0.05, "the catch-up")
    finally:
        proc.signal(signal.SIGTERM)
        proc.wait(60)
    assert set(remote_turns(pg_server, pgdb)) == set(local_turns(db))


def test_prune_drops_whole_days_and_cuts_the_day_it_falls_in(tmp_path, pg_server, pgdb):
    from click.testing import CliRunner

    from specproxy.app.cli import main

    day = 86400
    today = (time.time() // day) * day
    t_walls = [today - 2 * day + 100, today - 2 * day + 200, today - day + 100, today - day + 5000, today + 10]
    records = [record(i, t_wall=t) for i, t in enumerate(t_walls)]
    db = tmp_path / "a.db"
    write(db, records, [store_rows.turn_counters(records[0].id, "inst", 0.5, 10, 2, 8, 6, 2.5, 0.75)])
    shipper = ship(db, pg_server.url(pgdb))
    try:
        caught_up(shipper)
    finally:
        shipper.close()
    cut = today - day + 1000
    out = CliRunner().invoke(main, ["prune", "--db", pg_server.url(pgdb), "--before", str(cut), "--turns"])
    assert out.exit_code == 0, out.output
    assert "3 turns (1 whole day partitions dropped) and their 1 counter joins" in out.output
    assert set(remote_turns(pg_server, pgdb)) == {r.id for r in records[3:]}
    assert len(pg_rows(pg_server, pgdb, "SELECT inhrelid FROM pg_inherits WHERE inhparent = 'turns'::regclass")) == 2
    bad = CliRunner().invoke(main, ["prune", "--db", pg_server.url(pgdb, user="locked") .replace("locked@", "locked:pw@"),
                                    "--before", str(cut)])
    assert bad.exit_code == 2 and "holds a password" in bad.output


@pytest.mark.parametrize("url, why", [
    ("postgresql://u:secret-pw@h/db", "holds a password"),
    ("postgresql://u@h/db?password=secret-pw", "holds a password"),
    ("mysql://u@h/db", "unknown kind 'mysql'"),
    ("postgresql://u@h", "needs a host and a database"),
])
def test_a_bad_sink_url_is_one_line_and_never_echoes_a_password(url, why):
    from specproxy.config import load_config
    from specproxy.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(overrides={"sink": url})
    assert why in str(err.value) and "secret-pw" not in str(err.value) and "\n" not in str(err.value)


def test_sinks_and_proxy_name_from_the_config():
    from specproxy.config import Config, load_config

    cfg = load_config(env={"SPECPROXY_SINK": "postgresql://a@h1/x, postgresql://b@h2/y", "SPECPROXY_PROXY_NAME": "edge-7"})
    assert cfg.sinks == ("postgresql://a@h1/x", "postgresql://b@h2/y") and cfg.name_of_proxy == "edge-7"
    import socket

    assert Config().name_of_proxy == socket.gethostname() and Config().sinks == ()
