"""The fleet's read side against a real PostgreSQL (tests/pgserver.py): the same turns in an SQLite file and
in PostgreSQL give the same figures, primitive read by primitive read (store/pg_source.py against
store/sqlite_source.py) and command by command (``report``, ``compare``, ``audit``, ``export``). Then
the issue's "done when": four ``serve`` processes in front of two upstreams, each with its own SQLite
file and ``--sink`` to one PostgreSQL; once their shippers have caught up, report, compare and audit over
PostgreSQL equal the same over the union of their SQLite files. Issue 35. Every wait is for an event
(a row count), bounded.
"""

from __future__ import annotations

import json
import random
import re
import signal
import sqlite3
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from faultkit import wait_until
from pgserver import pg_count
from serveproc import LoopThread, ServeProcess
from specproxy.app.cli import main
from specproxy.app.fake_upstream import FakeUpstream, Script, make_record
from specproxy.store import rows
from specproxy.store.db import open_store
from specproxy.store.pg_source import PgSource
from specproxy.store.shipper import Shipper
from specproxy.store.sinks.postgres import PostgresSink
from specproxy.store.source import Window
from specproxy.store.sqlite_source import SQLiteSource
from specproxy.store.writer import Writer

T0 = 1_800_000_000.0
CHAT = "/v1/chat/completions"


def make_db(path: Path, seed: int = 5, n: int = 400, proxy: str = "edge-1", counter_seed: int = 1) -> Path:
    """``n`` turns over ~1 hour (labels, outcomes, instances, clients and sessions, NULLs, t_wall ties), rows
    of other paths, lone-turn counters for some (stored out of the turns' order: ``counter_seed`` says how),
    and scrapes with failures and a gap."""
    rng, crng = random.Random(seed), random.Random(counter_seed)
    w = Writer(path, queue_size=100_000)
    counters = []
    for i in range(n):
        t = T0 + i * 9.0 + (rng.random() * 30 if rng.random() < 0.1 else 0.0)
        if i and rng.random() < 0.03:
            t = prev  # a tie: ordered by insertion
        prev = t
        rec = make_record(seed=rng.random(), t_wall=t, label=rng.choice(["a", "b", None]),
                          instance_id=rng.choice(["i1", "i2"]), concurrency=rng.choice([1, 1, 2, 5]),
                          outcome="ok" if rng.random() > 0.1 else "client_abort",
                          decode_tps=rng.uniform(20, 90) if rng.random() > 0.05 else None,
                          client=rng.choice(["cli-x", "cli-y", None]), session=f"s{rng.randint(0, 20)}",
                          api="chat", prompt_new_tokens=rng.randint(1, 90), streamed=rng.random() > 0.1,
                          usage_cached_tokens=rng.choice([None, 512]), prefix_reused_tokens=rng.randint(0, 900),
                          conn_id=rng.randint(1, 30), proxy_name=proxy)
        w.put(rec)
        if rng.random() < 0.05:  # another path's row: forwarded, recorded, never a figure
            w.put(make_record(seed=rng.random(), t_wall=t + 1.0, label=rec.label, path="/v1/models",
                              measured=False, proxy_name=proxy))
        if rec.concurrency == 1 and rng.random() < 0.6:
            counters.append(rows.turn_counters(rec.id, rec.instance_id, 1.0, 100.0, 40.0, 80.0, 60.0,
                                               rng.choice([2.5, 1.8, 2.0 + rng.random(), None]), 0.75))
        if len(counters) > 3 and crng.random() < 0.3:  # stored later than their turns, and not in their order
            crng.shuffle(counters)
            w.put(counters.pop())
    for item in counters:
        w.put(item)
    t, tokens = T0 - 60.0, 0.0
    while t < T0 + n * 9.0 + 60:
        if T0 + 900 < t < T0 + 1300:  # no scrape at all here
            t += 5.0
            continue
        if rng.random() < 0.15:
            w.put(rows.failed_scrape(t, t - T0, "i1", "connection refused"))
        else:
            tokens += rng.randint(100, 900)
            w.put(rows.scrape((t, t - T0, rng.choice(["i1", "i2"]), "llamacpp", float(rng.randint(0, 5)), 0.0,
                               tokens, tokens * 3, tokens / 3, tokens / 1.5, tokens / 2, None, None, "[]", None),
                               latency_s=rng.choice([None, 0.01, rng.uniform(0.5, 6.0)])))
        t += rng.uniform(2.0, 8.0)
    w.close()
    return path


def ship(db: Path, url: str, name: str) -> None:
    shipper = Shipper(db, PostgresSink(url), name, idle_s=0.05, max_wait_s=0.5)
    shipper.start()
    try:
        assert shipper.caught_up.wait(60), f"the shipper did not catch up: {shipper.last_error}"
        assert shipper.rows_set_aside == 0
    finally:
        shipper.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, pg_server):
    """One SQLite file, and the same rows shipped to a fresh PostgreSQL database by the real shipper."""
    db = make_db(tmp_path_factory.mktemp("fleet-report") / "a.db")
    url = pg_server.url(pg_server.new_database())
    ship(db, url, "edge-1")
    return db, url


def test_a_fleet_database_no_sink_has_given_scrape_latency_yet_reads_as_sent_when_the_headers_came(
        tmp_path, pg_server):
    """A fleet's database that no proxy of this version has shipped to lacks ``scrapes.latency_s``
    (migration 007_scrape_latency): it is read, its scrapes as sent at their ``t_wall``, as a SQLite file
    whose latencies are NULL reads them."""
    import psycopg

    db = make_db(tmp_path / "a.db")
    url = pg_server.url(pg_server.new_database())
    ship(db, url, "edge-1")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ALTER TABLE scrapes DROP COLUMN latency_s")
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM scrapes WHERE latency_s > 0.1").fetchone()[0] > 20
        conn.execute("UPDATE scrapes SET latency_s = NULL")
    with SQLiteSource(db) as lite, PgSource(url) as pg:
        for t in (T0 - 100, T0 + 1000, T0 + 1500, T0 + 2000):
            assert lite.scrape_time(t, after=True) == pg.scrape_time(t, after=True) is not None
        a, b = lite.load(Window(), server=True, context=True), pg.load(Window(), server=True, context=True)
        assert len(b.scrapes) > 100 and np.isnan(b.scrapes.num["latency_s"]).all()
        assert np.array_equal(a.scrapes.sent(), b.scrapes.sent())
        assert np.array_equal(b.scrapes.sent(), b.scrapes.t_wall)


def test_lone_turn_figures_do_not_depend_on_the_order_counters_were_stored(tmp_path):
    """A fleet's database holds its proxies' counter joins in the order they were shipped, a union of their
    files in another: the lone-turn figures (means summed in some order) must be the same either way."""
    from specproxy.app.cli_common import report_of

    a = report_of(str(make_db(tmp_path / "a.db", counter_seed=1)), cache=False)
    b = report_of(str(make_db(tmp_path / "b.db", counter_seed=2)), cache=False)
    with sqlite3.connect(tmp_path / "a.db") as x, sqlite3.connect(tmp_path / "b.db") as y:
        order = "SELECT turn_id FROM turn_counters ORDER BY rowid"
        assert [r for r in x.execute(order)] != [r for r in y.execute(order)]  # stored in other orders
    assert a["server"]["lone_turns"]["joined"] > 20
    a.pop("source"), b.pop("source")
    assert a == b


def windows() -> list[Window]:
    rng = random.Random(9)
    out = [Window(), Window("a"), Window("nobody"), Window(since=T0 + 1000), Window(until=T0 + 1000),
           Window(since=T0 + 9000)]
    for _ in range(20):
        lo = T0 + rng.uniform(-100, 3700)
        out.append(Window(rng.choice([None, "a", "b"]), lo, lo + rng.choice([30.0, 300.0, 1500.0])))
    return out


def same_turns(x, y) -> None:
    assert len(x) == len(y) and set(x.num) == set(y.num) and set(x.txt) == set(y.txt)
    for k in x.num:
        if k == "rowid":  # each store's own key: the same order of the same turns, not the same numbers
            assert np.array_equal(np.argsort(x.num[k], kind="stable"), np.argsort(y.num[k], kind="stable"))
            continue
        assert x.num[k].dtype == y.num[k].dtype and np.array_equal(x.num[k], y.num[k], equal_nan=True), k
    for k in x.txt:
        assert x.txt[k].tolist() == y.txt[k].tolist(), k


def test_every_primitive_read_is_the_same(fleet):
    db, url = fleet
    with SQLiteSource(db) as lite, PgSource(url) as pg:
        assert lite.database() == pg.database() and lite.labels() == pg.labels() == ["a", "b"]
        fields = ("id", "t_wall", "label", "streamed", "concurrency", "decode_tps", "proxy_name")
        for w in windows():
            a, b = lite.turns(w), pg.turns(w)
            same_turns(a, b)
            assert lite.unmeasured(w) == pg.unmeasured(w)
            assert lite.recent(w, fields, 7) == pg.recent(w, fields, 7)
            assert lite.nth_newest_t_wall(w, 5) == pg.nth_newest_t_wall(w, 5)
            la, lb = lite.lone_joins(w), pg.lone_joins(w)
            # the joined turns by their place in the window's turns, the deltas in the order they were stored
            assert np.array_equal(np.searchsorted(a.num["rowid"][np.argsort(a.num["rowid"])], la.rowid),
                                  np.searchsorted(b.num["rowid"][np.argsort(b.num["rowid"])], lb.rowid))
            assert np.array_equal(la.mal, lb.mal, equal_nan=True)
            if len(a):
                da, db_ = lite.load(w, server=True, context=True), pg.load(w, server=True, context=True)
                for f in ("t_wall", "instance_id", "server_kind", "error"):
                    assert getattr(da.scrapes, f).tolist() == getattr(db_.scrapes, f).tolist()
                for f, v in da.scrapes.num.items():
                    assert np.array_equal(v, db_.scrapes.num[f], equal_nan=True)
        assert len(lite.turns(Window())) > 300  # the windows above were not all empty
        assert len(lite.lone_joins(Window()).mal) > 20
        for t in (T0 - 100, T0 + 1000, T0 + 1500, T0 + 9e5):
            for after in (False, True):
                for ok in (False, True):
                    assert lite.scrape_time(t, after=after, ok=ok) == pg.scrape_time(t, after=after, ok=ok)


def run(*args: str) -> str:
    out = CliRunner().invoke(main, list(args))
    assert out.exit_code == 0, out.output
    return out.output


def without_source(text: str) -> dict:
    """The command's JSON, but for ``source`` (the database's name, a path or a URL)."""
    out = json.loads(text)
    out.pop("source", None)
    return out


COMMANDS = [
    ("report", "--json"), ("report", "--json", "--label", "a"),
    ("report", "--json", "--since", str(T0 + 600), "--until", str(T0 + 2400)),
    ("report", "--json", "--since", str(T0 + 9e5)),  # selects nothing: says why from the whole store
    ("compare", "a", "b", "--json"), ("compare", "a", "--negative-control", "--json"),
    ("compare", f"@{T0}..{T0 + 1800}", f"@{T0 + 1800}..{T0 + 3600}", "--json"),
    ("audit", "--json"), ("audit", "--json", "--label", "b"),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c))
def test_the_commands_give_the_same_figures(fleet, command):
    db, url = fleet
    lite = without_source(run(*command, "--db", str(db)))
    assert lite == without_source(run(*command, "--db", url))
    if command[0] == "report" and "--since" not in command:
        assert lite["turns"] > 100 and lite["server"] is not None


def test_roofline_reads_the_fleet_too(fleet):
    db, url = fleet
    args = ("roofline", "--active-params", "8e9", "--bits", "4", "--bandwidth-gbs", "273", "--label", "a", "--json")
    lite, pg = json.loads(run(*args, "--db", str(db))), json.loads(run(*args, "--db", url))
    assert lite["measured_over"].pop("database") == str(db) and pg["measured_over"].pop("database") == url
    assert lite == pg and lite["measured_over"]["turns"] > 50 and lite["measured_passes_per_s"] > 0


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_export_is_the_same(fleet, fmt, tmp_path):
    db, url = fleet
    for window in ((), ("--label", "a", "--since", str(T0 + 100), "--until", str(T0 + 2000))):
        a, b = tmp_path / f"lite.{fmt}", tmp_path / f"pg.{fmt}"
        run("export", "--db", str(db), "--format", fmt, "-o", str(a), *window)
        run("export", "--db", url, "--format", fmt, "-o", str(b), *window)
        assert a.read_bytes() == b.read_bytes() and a.stat().st_size > 1000


def test_report_text_and_html_over_postgresql(fleet, tmp_path):
    db, url = fleet
    a, b = tmp_path / "lite.html", tmp_path / "pg.html"
    text = run("report", "--db", str(db), "--html", str(a)).replace(str(db), url).replace(str(a), str(b))
    assert text == run("report", "--db", url, "--html", str(b)) and "decode" in text
    written = re.compile(r"written [0-9: -]+ UTC")  # when each page was written
    assert written.sub("", a.read_text().replace(str(db), url)) == written.sub("", b.read_text())
    assert "<svg" in b.read_text()


def test_a_password_in_the_url_or_a_server_not_there_is_one_line(pg_server, refused):
    cases = {
        "postgresql://fleet:secret-pw@127.0.0.1:1/x": "holds a password",
        f"postgresql://fleet@127.0.0.1:{refused}/x": "cannot connect to",
    }
    for url, why in cases.items():
        for command in (("report",), ("audit",), ("compare", "a", "b"), ("export",)):
            out = CliRunner().invoke(main, [*command, "--db", url])
            assert out.exit_code == 2 and why in out.output, out.output
            assert out.output.count("\n") == 1 and "secret-pw" not in out.output and "Traceback" not in out.output


def test_a_user_that_may_only_read_is_enough(fleet, pg_server):
    db, url = fleet
    name = url.rsplit("/", 1)[1]
    denied = CliRunner().invoke(main, ["report", "--db", pg_server.url(name, user="reader")])
    assert denied.exit_code == 2 and "permission denied" in denied.output and denied.output.count("\n") == 1
    pg_server.admin("GRANT SELECT ON ALL TABLES IN SCHEMA public TO reader", db=name)
    try:
        as_reader = run("report", "--json", "--db", pg_server.url(name, user="reader"))
        assert as_reader == run("report", "--json", "--db", url).replace("fleet@", "reader@")
    finally:
        pg_server.admin("REVOKE SELECT ON ALL TABLES IN SCHEMA public FROM reader", db=name)


def test_a_database_no_proxy_shipped_to_reads_as_empty(pg_server):
    url = pg_server.url(pg_server.new_database())
    report = json.loads(run("report", "--json", "--db", url))
    assert report["turns"] == 0
    assert run("export", "--db", url) == ""


def test_commands_that_write_or_read_local_tables_refuse_a_url(pg_server, tmp_path):
    url = pg_server.url("postgres")
    for args in (["serve", "--upstream", "http://127.0.0.1:1", "--db", url],
                 ["export", "--format", "replay", "--db", url],
                 ["bench", "--upstream", "http://127.0.0.1:1", "--db", url, "--model", "m"]):
        out = CliRunner().invoke(main, args)
        assert out.exit_code == 2 and "give an SQLite file" in out.output, out.output
        assert out.output.count("\n") == 1


# --- four proxies, two upstreams, one PostgreSQL ----------------------------------------------------------


def chat(url: str, text: str, label: str) -> None:
    body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": text}]}).encode()
    req = urllib.request.Request(url + CHAT, body, {"Content-Type": "application/json", "X-Specproxy-Label": label,
                                                    "User-Agent": text.split()[-1]})
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()
        assert resp.status == 200


def local_count(db: Path, table: str) -> int:
    with sqlite3.connect(db) as conn:
        return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def union(files: list[Path], path: Path) -> Path:
    """One SQLite file holding every proxy's turns, scrapes and counter joins, copied row by row: the turns
    file by file (each proxy's in its own order), the scrapes by time (ties: by store and local id, as the
    fleet's database orders them), the counter joins file by file."""
    open_store(path).close()
    conn = sqlite3.connect(path)
    try:
        scrapes = []
        for f in files:
            conn.execute("ATTACH DATABASE ? AS f", (str(f),))
            conn.execute("INSERT INTO turns SELECT * FROM f.turns ORDER BY rowid")
            conn.execute("INSERT INTO turn_counters SELECT * FROM f.turn_counters ORDER BY rowid")
            (store_id,) = conn.execute("SELECT value FROM f.store_meta WHERE key = 'store_id'").fetchone()
            cols = [r[1] for r in conn.execute("PRAGMA f.table_info(scrapes)")]
            scrapes += [(r[1], store_id, r[0], r[1:]) for r in conn.execute(f"SELECT {', '.join(cols)} FROM f.scrapes")]
            conn.commit()
            conn.execute("DETACH DATABASE f")
        scrapes.sort(key=lambda s: (s[0], s[1], s[2]))
        conn.executemany(f"INSERT INTO scrapes ({', '.join(cols[1:])}) VALUES ({', '.join('?' * (len(cols) - 1))})",
                         [s[3] for s in scrapes])
        conn.commit()
    finally:
        conn.close()
    return path


@pytest.fixture
def two_upstreams():
    lt = LoopThread()
    ups = [FakeUpstream(Script(pieces=["a", "b", "c", "d"], tokens_per_chunk=1, interval_s=0.002)),
           FakeUpstream(Script(pieces=["a", "b", "c", "d", "e", "f"], tokens_per_chunk=2, interval_s=0.004))]
    for up in ups:
        lt.run(up.start())
    yield ups
    for up in ups:
        lt.run(up.close())
    lt.close()


def test_four_proxies_in_postgresql_equal_the_union_of_their_files(tmp_path, pg_server, two_upstreams):
    url = pg_server.url(pg_server.new_database())
    files = [tmp_path / f"edge-{k}.db" for k in range(4)]
    procs = []
    try:
        for k, db in enumerate(files):  # proxies 0 and 2 before one upstream, 1 and 3 before the other
            procs.append(ServeProcess(tmp_path, two_upstreams[k % 2].url, db, "--sink", url, "--proxy-name",
                                      f"edge-{k}", "--scrape-interval", "0.2", "--tokenizer", "tiktoken:o200k_base",
                                      name=f"edge-{k}"))
        per_proxy = 12
        for i in range(per_proxy):
            for k, proc in enumerate(procs):  # each proxy's own conversations and client; arms a and b on all
                chat(proc.url, f"turn {i} of conversation edge{k}", "a" if i % 2 else "b")
        total = per_proxy * len(procs)
        wait_until(lambda: sum(local_count(db, "turns") for db in files) == total, 60, 0.05, "turns recorded")
        wait_until(lambda: pg_count(url, "turns") == total, 120, 0.05, "the shippers to ship every turn")
    finally:
        for proc in procs:
            proc.signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(60)
    # what the proxies scraped and joined after their last turn ships when each starts again: here, its shipper
    for k, db in enumerate(files):
        ship(db, url, f"edge-{k}")
    assert pg_count(url, "scrapes") == sum(local_count(db, "scrapes") for db in files) > 8
    assert pg_count(url, "turn_counters") == sum(local_count(db, "turn_counters") for db in files) > 0
    whole = union(files, tmp_path / "union.db")
    for command in (("report", "--json"), ("report", "--json", "--label", "a"), ("compare", "a", "b", "--json"),
                    ("audit", "--json")):
        lite = without_source(run(*command, "--db", str(whole)))
        assert lite == without_source(run(*command, "--db", url)), command
    report = json.loads(run("report", "--json", "--db", url))
    assert report["turns"] == total and report["server"]["lone_turns"]["joined"] > 0
    assert [(row["proxy"], row["turns"]) for row in report["by_proxy"]] == [(f"edge-{k}", per_proxy) for k in range(4)]
    assert len(report["by_instance"]) == 2 and sum(row["turns"] for row in report["by_instance"]) == total
    html = tmp_path / "fleet.html"
    run("report", "--db", url, "--html", str(html))
    page = html.read_text()
    assert 'id="by-proxy"' in page and 'id="by-instance"' in page and all(f"edge-{k}" in page for k in range(4))
    audit = json.loads(run("audit", "--json", "--db", url))
    assert audit["turns"] == total and len(audit["clients"]) == 4
