"""Config precedence and validation; store migrations, the writer thread, drops and bad rows."""

from __future__ import annotations

import queue
import re
import sqlite3
import threading
from pathlib import Path

import pytest

from specproxy.config import KEYS, load_config
from specproxy.errors import ConfigError, StoreError
from specproxy.store.db import MIGRATIONS, connect, migrate
from specproxy.store.writer import Writer
from specproxy.app.fake_upstream import make_record

ROOT = Path(__file__).resolve().parents[2]


def test_precedence_file_env_flags(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('upstream = "http://127.0.0.1:9"\nport = 1000\nlabel = "file"\n')
    cfg = load_config(f, env={"SPECPROXY_PORT": "2000", "SPECPROXY_LABEL": "env"}, overrides={"label": "flag", "port": None})
    assert (cfg.upstream, cfg.port, cfg.label) == ("http://127.0.0.1:9", 2000, "flag")


@pytest.mark.parametrize("text, message", [
    ("port = 'x'", "port must be int"),
    ("nope = 1", "unknown key"),
    ("scan = 'python'", "'scan' was removed: the measuring reads streams with its C scans"),
    ("upstream = 'ftp://x'", "not an http"),
    ("[[", "not valid TOML"),
    ("client_header = 'Authorization'", "may carry credentials"),
    ("client_header = 'x client'", "not a header name"),
    ("relay_nice = 5", "relay_nice must be -20 to 0"),
    ("relay_nice = -21", "relay_nice must be -20 to 0"),
])
def test_bad_config_is_one_clear_error(tmp_path, text, message):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(f, env={})


def test_a_removed_setting_in_the_environment_is_one_clear_error():
    with pytest.raises(ConfigError, match="SPECPROXY_SCAN was removed: .*; delete it$"):
        load_config(env={"SPECPROXY_SCAN": "c"})


@pytest.mark.parametrize("name", [
    "Authorization", "proxy-authorization", "cookie", "x-api-key", "x-goog-api-key", "api-key", "apikey",
    "X-Auth-Token", "x-access-token", "x-client-secret", "x-session-id", "x-password", "x-csrf-token",
    "x-amz-security-token", "x-sid", "x_user_pwd", "x-oauth", "ocp-apim-subscription-key", "x-signature",
])
def test_client_header_refuses_every_credential_header(name):
    """Its value is stored verbatim: a header that may carry a credential, by name or by shape, is
    refused at start-up with one line."""
    with pytest.raises(ConfigError, match="may carry credentials") as err:
        load_config(env={}, overrides={"client_header": name})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["user-agent", "x-client-name", "x-title", "x-stainless-lang", "http-referer"])
def test_client_header_takes_a_client_name(name):
    assert load_config(env={}, overrides={"client_header": name}).client_header == name


def test_example_config_documents_every_key():
    text = (ROOT / "config.example.toml").read_text()
    documented = set(re.findall(r"^#?\s*([a-z_]+)\s*=", text, re.M))
    assert documented == set(KEYS)
    load_config(ROOT / "config.example.toml", env={})  # and it parses


def test_migrations_are_named_and_idempotent(tmp_path):
    conn = connect(tmp_path / "a.db")
    assert migrate(conn) == [name for name, _ in MIGRATIONS]
    assert migrate(conn) == []
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_unwritable_database_path_is_a_clear_error(tmp_path):
    with pytest.raises(StoreError, match="does not exist"):
        Writer(tmp_path / "missing-dir" / "x.db")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        import os

        if os.geteuid() != 0:  # root writes anywhere
            with pytest.raises(StoreError):
                Writer(ro / "x.db")
    finally:
        ro.chmod(0o700)


def test_writer_writes_and_drains_on_close(tmp_path):
    w = Writer(tmp_path / "t.db")
    recs = [make_record(seed=i) for i in range(2500)]
    for r in recs:
        assert w.put(r)
    w.close()
    conn = sqlite3.connect(tmp_path / "t.db")
    # the writer's own account, should this fail again (it did, 1 run in 4 after test_relay_thread.py and
    # test_cli.py: a spurious Empty at close, test_a_spurious_empty_at_close_loses_no_record)
    state = {k: getattr(w, k) for k in ("written", "dropped", "retries", "bad_rows", "last_error")}
    state["alive"] = w._thread.is_alive()
    assert conn.execute("SELECT count(*) FROM turns").fetchone()[0] == 2500, state
    assert w.written == 2500 and w.dropped == 0, state


class RacingQueue:
    """A ``SimpleQueue`` whose first timed ``get`` raises Empty once the writer is stopping, with records
    queued: what CPython's does when its wait times out as a put lands (found by the test above failing
    1 run in 4 beside test_relay_thread.py and test_cli.py: nothing written, 2,500 still queued)."""

    def __init__(self, stopping: threading.Event) -> None:
        self._q = queue.SimpleQueue()
        self._stopping = stopping
        self.raced = False

    def put(self, item) -> None:
        self._q.put(item)

    def qsize(self) -> int:
        return self._q.qsize()

    def empty(self) -> bool:
        return self._q.empty()

    def get_nowait(self):
        return self._q.get_nowait()

    def get(self, timeout=None):
        if not self.raced:
            self._stopping.wait(10)  # the timed get under way when close() comes
            self.raced = True
            raise queue.Empty
        return self._q.get(timeout=timeout)


def test_a_spurious_empty_at_close_loses_no_record(tmp_path):
    w = Writer(tmp_path / "t.db")
    racing = w._queue = RacingQueue(w._stop)  # the thread takes it at its next get (within 0.1 s)
    for i in range(50):
        assert w.put(make_record(seed=i))
    w.close()
    assert racing.raced, "the writer never met the race: the test did not test it"
    conn = sqlite3.connect(tmp_path / "t.db")
    assert conn.execute("SELECT count(*) FROM turns").fetchone()[0] == 50
    assert w.written == 50 and w.dropped == 0


def test_a_record_is_written_as_soon_as_it_is_ready(tmp_path):
    """An idle writer writes a record at once, not after waiting for more (issue 32: a SIGKILL lost the
    turns of the last quarter second); the commit gap then holds what comes next for the next commit,
    and ``close`` writes it without waiting out the gap."""
    import time

    w = Writer(tmp_path / "t.db", commit_gap_s=60.0)
    try:
        assert w.put(make_record(seed=1))
        deadline = time.monotonic() + 10.0
        while w.written < 1 and time.monotonic() < deadline:  # bounded: a writer that lingers waits 0.25 s+
            time.sleep(0.001)
        assert w.written == 1
        assert w.put(make_record(seed=2))
        time.sleep(0.05)  # not a stand-in for an event: within the 60 s gap nothing more is committed
        assert w.written == 1 and w.pending == 1  # held for the next commit, and counted as waiting
    finally:
        w.close()  # close does not wait out the gap: the second is written now
    assert w.written == 2


def test_full_queue_drops_and_counts_never_blocks(tmp_path):
    path = tmp_path / "t.db"
    w = Writer(path, queue_size=10)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # someone else holds the database
    try:
        accepted = sum(w.put(make_record(seed=i)) for i in range(200))
        assert accepted < 200 and w.dropped == 200 - accepted
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    w.close()
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT count(*) FROM turns").fetchone()[0] == accepted  # the accepted ones all landed


def test_a_bad_string_does_not_cost_the_batch(tmp_path):
    w = Writer(tmp_path / "t.db")
    w.put(make_record(model="ok-1"))
    w.put(make_record(model="lone \ud800 surrogate"))
    w.put(make_record(model="ok-2"))
    w.close()
    rows = sqlite3.connect(tmp_path / "t.db").execute("SELECT model FROM turns ORDER BY model").fetchall()
    assert [r[0] for r in rows] == ["lone \ufffd surrogate", "ok-1", "ok-2"]


def test_generated_docs_are_current():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_docs.py"), "--check"], capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_an_older_database_is_upgraded_in_place(tmp_path):
    """A database made by an earlier specproxy (three migrations) gains the later columns, keeps its rows."""
    import sqlite_utils

    conn = connect(tmp_path / "old.db")
    conn.execute("CREATE TABLE _migrations (name TEXT PRIMARY KEY, applied_at REAL)")
    db = sqlite_utils.Database(conn)
    for name, statements in MIGRATIONS[:3]:
        for sql in statements:
            conn.execute(sql)
        conn.execute("INSERT INTO _migrations VALUES (?, 0)", (name,))
    conn.execute("INSERT INTO turns (id, t_wall, method, path, outcome) VALUES ('old', 1, 'POST', '/v1/chat/completions', 'ok')")
    assert "content_class" not in {c.name for c in db["turns"].columns}
    assert migrate(conn) == [name for name, _ in MIGRATIONS[3:]]
    assert "content_class" in {c.name for c in db["turns"].columns}
    assert conn.execute("SELECT id FROM turns").fetchall() == [("old",)]


# The SQL of every released migration, by hash. A released migration never changes (a database made by
# an older version must pass through the same steps as a new one): change the schema with a new one.
RELEASED_MIGRATIONS = {
    "001_turns": "f9b8c110f213da6e",
    "002_scrapes_and_instances": "ab7aac715ff2810a",
    "003_turn_counters_and_scrape_errors": "feb1a0aeee70393d",
    "004_content_class": "b6b47577cdc3e566",
    "005_api_client_session": "daab89802ad097ea",
    "006_captures": "91025f279d1da1ef",
    "007_measure_capped": "441166bf0dc78090",
    "008_unmeasured_prefix_tools": "20f30dc388f03952",
    "009_conn_id": "891a04132d7cd1a3",
    "010_measure_capped_reason": "253f4e113eb5d570",
    "011_fleet": "f2a96c8b284de9c4",
    "012_tenant": "c18990472c627a7e",
    "013_prefix_cache": "66dfd3337b2aaa51",
    "014_prompt_block_digests": "2f81afa0ba32d252",
    "015_table_edits": "fbb236bb460825ba",
    "016_unmeasured_index": "fa8ad0e5a1b1c99a",
    "017_scrape_latency": "3b275c6ee8d5297e",
}


def _migration_hash(statements) -> str:
    import hashlib

    return hashlib.sha256("\n;\n".join(statements).encode()).hexdigest()[:16]


def test_released_migrations_never_change():
    hashes = {name: _migration_hash(statements) for name, statements in MIGRATIONS}
    assert {name: hashes[name] for name in RELEASED_MIGRATIONS} == RELEASED_MIGRATIONS
    assert list(hashes)[:len(RELEASED_MIGRATIONS)] == list(RELEASED_MIGRATIONS), "a new migration goes last"


def test_the_migrated_turns_table_is_the_record(tmp_path):
    """Every Record field is a column of the type the store writes, and no column is left over."""
    import dataclasses

    from specproxy.record import Record

    conn = connect(tmp_path / "a.db")
    migrate(conn)
    columns = {row[1]: row[2] for row in conn.execute("PRAGMA table_info(turns)")}

    def sql_type(annotation: str) -> str:
        if "bool" in annotation or annotation.startswith("int"):
            return "INTEGER"
        return "REAL" if annotation.startswith("float") else "TEXT"

    assert columns == {f.name: sql_type(str(f.type)) for f in dataclasses.fields(Record)}


def test_every_config_key_is_a_serve_flag_or_says_why_not():
    """Help and config cannot drift: a new Config field needs a serve flag, or a reason in CONFIG_ONLY."""
    from specproxy.app.serve_cli import CONFIG_ONLY, serve

    flags = {p.name for p in serve.params if p.name not in ("config_path", "help")}
    assert flags <= set(KEYS), flags - set(KEYS)
    assert flags | set(CONFIG_ONLY) == set(KEYS), set(KEYS) - flags - set(CONFIG_ONLY)
    assert not flags & set(CONFIG_ONLY) and all(CONFIG_ONLY.values())


def test_serve_help_shows_every_default_and_that_upstream_is_required():
    from click.testing import CliRunner

    from specproxy.app.cli import main
    from specproxy.app.serve_cli import serve
    from specproxy.config import Config

    def typed(value):  # how a user types the default
        if value is None:
            return "none"
        if isinstance(value, bool):
            return "on" if value else "off"
        return f"{value:g}" if isinstance(value, float) else str(value)

    for p in serve.params:
        if p.name in KEYS and p.name != "upstream":
            assert p.help.endswith(f"[default: {typed(getattr(Config(), p.name))}]"), (p.name, p.help)
    text = " ".join(CliRunner().invoke(main, ["serve", "--help"]).stdout.split())
    assert "[required unless set in the --config file or SPECPROXY_UPSTREAM]" in text
    for flag in ("--max-body-bytes", "--connect-timeout", "--header-timeout", "--queue-size", "--metrics-path",
                 "--scrape-retention-days"):
        assert f"{flag} " in text


def test_the_memory_budget_has_room_for_the_largest_body():
    from specproxy.errors import ConfigError

    assert load_config(env={}, overrides={"memory_budget_bytes": 64 << 20}).memory_budget_bytes == 64 << 20
    for bad in (-1, (64 << 20) - 1):
        with pytest.raises(ConfigError, match="memory_budget_bytes"):
            load_config(env={}, overrides={"memory_budget_bytes": bad})


def test_a_refused_batch_is_split_so_whatever_fits_is_written():
    """Issue 32: a batch larger than the room left never committed, even once some room came back. The
    writer writes the longest prefix that commits (halving), passes over one record too large on its own,
    and gives back the rest in order; with no room at all it stops after two halvings."""

    class Sized(Writer):  # _write_what_fits alone: a "record" is its size, the room is ``room``
        def __init__(self, room: int, full: bool = True) -> None:
            self.room, self.tried, self._held, self._full = room, [], 0, full

        def _write(self, items: list) -> bool:
            self.tried.append(len(items))
            if sum(items) > self.room or not self._full:
                return False
            self.room -= sum(items)
            return True

    w = Sized(10)
    assert w._write_what_fits([3, 3, 3, 3, 3]) == [3, 3] and w._held == 2  # three fit: written
    w = Sized(10)
    assert w._write_what_fits([20, 1, 1, 1]) == [20]  # the large one waits, the small ones behind it do not
    w = Sized(10)
    assert w._write_what_fits([20, 1, 30, 1]) == [20, 30, 1]
    w = Sized(0)
    assert w._write_what_fits([1] * 1000) == [1] * 1000
    assert len(w.tried) == 20  # log2(1000) + 1 attempts, twice: not one per record
    w = Sized(10, full=False)  # locked: no part of a batch would go in, so none is tried
    assert w._write_what_fits([1] * 1000) == [1] * 1000 and w.tried == [1000]
