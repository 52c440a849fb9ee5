"""The scrapes table is bounded: the writer deletes old scrapes (never turns), `specproxy prune` deletes
by hand, and the growth per day the docs state is what the real store code writes."""

from __future__ import annotations

import json
import re
import sqlite3
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from specproxy.store import retention
from specproxy.app.cli import main
from specproxy.config import Config, load_config
from specproxy.fielddocs import field_docs
from specproxy.serve.watch import ServerWatch
from specproxy.store.retention import ScrapeRetention
from specproxy.observe.scrape import ScrapeSample, parse_exposition
from specproxy.store.db import open_store
from specproxy.store.writer import Writer
from pages import LLAMACPP_PAGE

DAY = 86400.0
DEADLINE_S = 10.0


def _fill(path: Path, *, scrapes: list[float] = (), turns: list[float] = (), joined: int = 0) -> None:
    """Scrapes and turns at these wall times; the first ``joined`` turns have a turn_counters row."""
    conn = open_store(path)
    conn.executemany("INSERT INTO scrapes (t_wall, t_mono, raw) VALUES (?, 0, '[]')", [(t,) for t in scrapes])
    conn.executemany("INSERT INTO turns (id, t_wall, method, path, outcome) VALUES (?, ?, 'POST', '/v1/x', 'ok')",
                     [(f"t{i}", t) for i, t in enumerate(turns)])
    conn.executemany("INSERT INTO turn_counters (turn_id, seconds) VALUES (?, 1)", [(f"t{i}",) for i in range(joined)])
    conn.close()


def _count(path: Path, table: str, where: str = "1") -> int:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(f"SELECT count(*) FROM {table} WHERE {where}").fetchone()[0]
    finally:
        conn.close()


def test_the_writer_deletes_old_scrapes_at_start_up_and_keeps_new_ones_and_every_turn(tmp_path):
    now = time.time()
    db = tmp_path / "t.db"
    _fill(db, scrapes=[now - 40 * DAY] * 5 + [now - 10 * DAY] * 3, turns=[now - 40 * DAY] * 2)
    w = Writer(db, scrape_retention_days=30)
    w.close()  # the thread's first step is the start-up delete; close waits for the thread
    assert w.retention.deleted == 5
    assert _count(db, "scrapes") == 3 and _count(db, "scrapes", f"t_wall < {now - 30 * DAY}") == 0
    assert _count(db, "turns") == 2  # turns are the measurements: only prune --turns deletes them


def test_zero_days_keeps_every_scrape(tmp_path):
    db = tmp_path / "t.db"
    _fill(db, scrapes=[time.time() - 4000 * DAY] * 3)
    w = Writer(db, scrape_retention_days=0)
    w.close()
    assert _count(db, "scrapes") == 3


def test_a_backlog_is_deleted_chunk_by_chunk_between_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(retention, "PRUNE_CHUNK", 4)
    db = tmp_path / "t.db"
    _fill(db, scrapes=[time.time() - 40 * DAY] * 10)
    w = Writer(db, scrape_retention_days=30)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while w.retention.deleted < 10 and time.monotonic() < deadline:
            w._stop.wait(0.01)  # the writer's thread deletes; this one only looks
        assert w.retention.deleted == 10 and _count(db, "scrapes") == 0
    finally:
        w.close()


def test_the_schedule_is_start_up_then_hourly_and_at_once_while_a_chunk_was_full(tmp_path, monkeypatch):
    monkeypatch.setattr(retention, "PRUNE_CHUNK", 2)
    db = tmp_path / "t.db"
    now = 1_800_000_000.0
    _fill(db, scrapes=[now - 40 * DAY] * 3)
    conn = open_store(db)
    mono = [100.0]
    r = ScrapeRetention(30, wall=lambda: now, mono=lambda: mono[0])
    assert r.run_if_due(conn) == 2  # start-up; a full chunk: more are waiting
    assert r.run_if_due(conn) == 1  # at once
    _fill(db, scrapes=[now - 31 * DAY])
    assert r.run_if_due(conn) == 0  # not due: the last chunk was not full
    mono[0] += retention.PRUNE_EVERY_S - 1
    assert r.run_if_due(conn) == 0
    mono[0] += 1
    assert r.run_if_due(conn) == 1  # an hour after the last delete
    conn.close()


def test_retention_is_a_setting_from_every_source(tmp_path):
    assert Config().scrape_retention_days == 30
    assert load_config(env={"SPECPROXY_SCRAPE_RETENTION_DAYS": "7"}).scrape_retention_days == 7
    with pytest.raises(Exception, match="scrape_retention_days must be >= 0"):
        load_config(env={}, overrides={"scrape_retention_days": -1})


# --- the documented growth ----------------------------------------------------------------------


def _llamacpp_page(i: int) -> str:
    """llama.cpp's page after i polls of a busy server: counters with realistic digits, growing."""
    return LLAMACPP_PAGE.format(prompt=1_000_000 + 97 * i, predicted=2_000_000 + 313 * i,
                                draft_tokens=5_000_000 + 800 * i, accepted=3_000_000 + 611 * i,
                                drafts=900_000 + 101 * i, processing=i % 4)


def test_growth_per_day_at_the_default_interval_is_what_the_docs_say(tmp_path):
    """A quarter of a day of llama.cpp scrapes at the default interval, through the real path (the page
    parsed, the row built by ServerWatch, inserted by the Writer, the file checkpointed on close); the
    file's growth times four must not exceed the figure in scrape_retention_days' documentation (which
    config.example.toml repeats), nor be under half of it."""
    doc = field_docs(Config)["scrape_retention_days"]
    documented_mb = float(re.search(r"about (\d+) MB a day", doc).group(1))
    rows = int(DAY / Config().scrape_interval_s) // 4
    db = tmp_path / "growth.db"
    Writer(db).close()
    empty = db.stat().st_size
    w = Writer(db, queue_size=rows + 1)
    watch = ServerWatch(load_config(env={}, overrides={"upstream": "http://127.0.0.1:9"}), w)
    t0 = 1_790_000_000.0
    for i in range(rows):
        t = i * Config().scrape_interval_s
        watch._store(ScrapeSample(t_mono=t, t_wall=t0 + t, snapshot=parse_exposition(_llamacpp_page(i)),
                                  instance_id="llamacpp-0123456789abcdef"))
    w.close()
    assert w.dropped == 0 and _count(db, "scrapes") == rows
    per_day_mb = (db.stat().st_size - empty) * 4 / 1e6
    print(f"llama.cpp scrapes: {per_day_mb:.1f} MB a day at {Config().scrape_interval_s:g} s")
    assert documented_mb / 2 <= per_day_mb <= documented_mb, (per_day_mb, documented_mb)


# --- specproxy prune --------------------------------------------------------------------------------


def _prune(db: Path, *args: str):
    return CliRunner().invoke(main, ["prune", "--db", str(db), *args])


def test_prune_deletes_scrapes_before_the_date_and_says_how_many(tmp_path):
    db = tmp_path / "p.db"
    _fill(db, scrapes=[1_700_000_000.0] * 4 + [1_800_000_000.0], turns=[1_700_000_000.0] * 3)
    r = _prune(db, "--before", "2025-01-01")
    assert r.exit_code == 0, r.output
    assert r.stdout == f"deleted 4 scrapes from before 2025-01-01T00:00:00Z in {db}\n"
    assert _count(db, "scrapes") == 1 and _count(db, "turns") == 3


def test_prune_turns_deletes_them_and_their_counter_joins_and_the_report_follows(tmp_path):
    db = tmp_path / "p.db"
    _fill(db, turns=[1_700_000_000.0] * 3 + [1_760_000_000.0] * 2, joined=4)
    report = lambda: json.loads(CliRunner().invoke(main, ["report", "--db", str(db), "--json"]).stdout)["turns"]  # noqa: E731
    assert report() == 5  # and the column cache is built
    r = _prune(db, "--before", "2025-01-01", "--turns")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("deleted 0 scrapes, 3 turns and their 3 counter joins from before 2025-01-01")
    assert _count(db, "turns") == 2 and _count(db, "turn_counters") == 1
    assert report() == 2  # the cache saw the rows go


def test_prune_vacuum_gives_the_space_back(tmp_path):
    db = tmp_path / "p.db"
    _fill(db, scrapes=[1_700_000_000.0] * 20000)
    before = db.stat().st_size
    r = _prune(db, "--before", "2025-01-01", "--vacuum")
    assert r.exit_code == 0, r.output
    assert "vacuumed:" in r.stdout and db.stat().st_size < before / 4


@pytest.mark.parametrize("args, message", [
    (["--before", "2999-01-01"], "is in the future"),
    (["--before", "last week"], "cannot read time"),
])
def test_prune_refuses_what_it_cannot_do_safely(tmp_path, args, message):
    db = tmp_path / "p.db"
    _fill(db, scrapes=[1_700_000_000.0])
    r = _prune(db, *args, "--turns")
    assert r.exit_code == 2 and message in r.stderr and _count(db, "scrapes") == 1


def test_prune_does_not_create_a_database(tmp_path):
    r = _prune(tmp_path / "none.db", "--before", "2025-01-01")
    assert r.exit_code == 2 and "database does not exist" in r.stderr and not list(tmp_path.iterdir())
