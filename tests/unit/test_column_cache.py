"""The columnar cache never changes a number: reports from it equal reports from SQLite, on the same
real database, through appends, deletions, replaced files, schema changes, hand edits, corrupted
or half-written cache files and cache locations that cannot be written."""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import random
import shutil
import sqlite3
import sys
import threading
from pathlib import Path

import numpy as np
import orjson
import pytest

from specproxy.store.source import Window
from specproxy.store.sqlite_source import SQLiteSource
from specproxy.store import column_cache, column_segments
from specproxy.analyze.compare import COMPARE_COLUMNS, Arm, compare, negative_control_report
from specproxy.store.dataset import NUMERIC, TEXT, load_turns
from specproxy.store import rows
from specproxy.analyze.report_data import REPORT_COLUMNS, build_report
from specproxy.analyze.report import render_text
from specproxy.store.db import connect
from specproxy.store.writer import Writer
from specproxy.app.fake_upstream import make_record


def write_turns(path: Path, n: int, *, seed: int, t0: float = 1_790_000_000.0) -> list[str]:
    """n varied turns through the store's own writer: labels, instances, outcomes, NULLs, equal and
    out-of-order wall times, content classes; and counter deltas for some of them. Their ids."""
    rng = random.Random(seed)
    w = Writer(path)
    ids = []
    for i in range(n):
        ok = rng.random() > 0.1
        rec = make_record(
            seed=rng.random(),
            t_wall=t0 + (i // 3) * 7.0 + (rng.random() * 50 if rng.random() < 0.1 else 0.0),  # ties, disorder
            label=rng.choice(["old", "new", None]),
            instance_id=rng.choice(["inst-a", "inst-b", None]),
            concurrency=rng.choice([1, 1, 2, 4, 9, 40]),
            content_class=rng.choice(["prose", "code", "tool_call", None]),
            outcome="ok" if ok else rng.choice(["client_abort", "upstream_error"]),
            decode_tps=rng.uniform(20, 90) if rng.random() > 0.05 else None,
            usage_completion_tokens=rng.randint(50, 800) if rng.random() > 0.3 else None,
            prompt_tokens=rng.choice([500, 3000, 9000, 40000]),
            tokens_per_chunk=rng.choice([1.0, 1.7, 2.4]),
            streamed=rng.random() > 0.1,
        )
        ids.append(rec.id)
        w.put(rec)
        if rec.concurrency == 1 and rng.random() < 0.5:
            w.put(rows.turn_counters(rec.id, rec.instance_id, 1.0, 100.0, 40.0, 80.0, 60.0,
                                     rng.choice([2.5, 0.0, None]), 0.75))
    w.close()
    return ids


def report_json(db: Path, cache: bool, **window) -> str:
    conn = connect(db, readonly=True)
    try:
        data = SQLiteSource(conn, cache=cache).load(Window(**window), REPORT_COLUMNS, server=True, context=True)
        r = build_report(data, source="db")
    finally:
        conn.close()
    return orjson.dumps(r, option=orjson.OPT_SERIALIZE_NUMPY).decode() + render_text(r)


WINDOWS = [{}, {"label": "old"}, {"label": "new"}, {"since": 1_790_000_700.0}, {"until": 1_790_000_300.0},
           {"label": "new", "since": 1_790_000_100.0, "until": 1_790_000_900.5}, {"label": "nobody"}]


def assert_same(db: Path, expect: str | None = None) -> str:
    """Every window: the cached report equals the SQLite one. Returns what the cache did first."""
    status = None
    for window in WINDOWS:
        plain = report_json(db, False, **window)
        cached = report_json(db, True, **window)
        status = status or column_cache.last_status
        assert cached == plain, (window, column_cache.last_status)
    if expect is not None:
        assert status == expect
    return status


def assert_turns_equal(db: Path) -> None:
    """Column by column, with every column and the rowids: not just the figures that come out."""
    cols = [c for c in load_turns(db).num] + [c for c in TEXT if c != "id"]
    cols = [c for c in cols if c != "rowid"]
    a = load_turns(db, columns=cols)
    b = load_turns(db, columns=cols, cache=True)
    assert column_cache.last_status in ("hit", "append", "build")
    assert set(a.num) == set(b.num) and set(a.txt) == set(b.txt)
    for k in a.num:
        assert a.num[k].dtype == b.num[k].dtype and np.array_equal(a.num[k], b.num[k], equal_nan=True), k
    for k in a.txt:
        assert a.txt[k].tolist() == b.txt[k].tolist(), k


@pytest.fixture
def db(tmp_path) -> Path:
    path = tmp_path / "turns.db"
    write_turns(path, 400, seed=1)
    return path


def test_cached_report_equals_sqlite_report_cold_and_warm(db):
    assert not column_cache.cache_dir(db).exists()
    assert_same(db, expect="build")
    assert (column_cache.cache_dir(db) / "manifest.json").exists()
    assert_same(db, expect="hit")
    assert_turns_equal(db)


def test_appended_turns_are_read_incrementally(db):
    assert_same(db, expect="build")
    write_turns(db, 150, seed=2, t0=1_790_000_500.0)  # overlapping times: the order must still agree
    assert_same(db, expect="append")
    assert_same(db, expect="hit")
    for seed in range(3, 3 + column_cache.MAX_SEGMENTS + 1):  # more segments than kept: merged
        write_turns(db, 5, seed=seed, t0=1_790_002_000.0 + seed)
        assert_same(db, expect="append")
    assert len(_manifest(db)["turns"]["segments"]) <= column_cache.MAX_SEGMENTS
    assert len([p for p in column_cache.cache_dir(db).iterdir() if p.name.startswith("seg-")]) <= column_cache.MAX_SEGMENTS + 2
    assert_same(db, expect="hit")
    assert_turns_equal(db)


def _manifest(db: Path) -> dict:
    m = json.loads((column_cache.cache_dir(db) / "manifest.json").read_text())
    assert m["format"] == column_cache.FORMAT
    return m["tables"]


def _sql(db: Path, *statements: str) -> None:
    conn = sqlite3.connect(db, isolation_level=None)  # autocommit: VACUUM runs outside a transaction
    for s in statements:
        conn.execute(s)
    conn.close()


@pytest.fixture
def unsampled(monkeypatch):
    """Only the first and the last cached row sampled: what the database's edit counter sees, not luck."""
    monkeypatch.setattr(column_cache, "SAMPLED_ROWS", 0)


@pytest.mark.parametrize("edit", [
    "DELETE FROM turns WHERE rowid % 7 = 3",  # pruning old rows
    "DELETE FROM turns WHERE rowid = (SELECT max(rowid) FROM turns)",  # the newest row
    "DELETE FROM turns WHERE rowid = (SELECT min(rowid) FROM turns)",  # the oldest row
    "DELETE FROM turns WHERE rowid = 123",  # one row in the middle
    "UPDATE turns SET label = 'new' WHERE label = 'old' AND rowid % 2 = 0",  # relabelled by hand
    "UPDATE turns SET t_wall = t_wall + 0.000002 WHERE rowid = 200",  # two microseconds
    "UPDATE turns SET ttft_s = NULL",  # every row of another column
    "UPDATE turns SET decode_tps = 1.5 WHERE rowid = 123",  # one value of one row, not label nor t_wall
    "UPDATE turns SET outcome = 'client_abort' WHERE rowid = 77",  # a text column
])
def test_deleted_or_edited_rows_rebuild(db, edit, unsampled):
    assert_same(db, expect="build")
    _sql(db, edit)
    assert_same(db, expect="build")
    assert_same(db, expect="hit")


def test_every_edit_is_counted_by_the_database(db):
    """The counter the cache is keyed on: UPDATE, DELETE and INSERT OR REPLACE of an existing id count,
    a new row does not (the cache reads it as an append); per table."""
    def edits():
        c = sqlite3.connect(db)
        got = dict(c.execute("SELECT name, edits FROM table_edits"))
        c.close()
        return got

    start = edits()
    assert start == {"turns": 0, "scrapes": 0}
    (tid,) = sqlite3.connect(db).execute("SELECT id FROM turns WHERE rowid = 10").fetchone()
    w = Writer(db)
    w.put(make_record(t_wall=1_790_000_000.5))  # a new turn
    w.put(rows.failed_scrape(1_790_000_000.0, 1.0, "i", "refused"))  # a new scrape
    w.close()
    assert edits() == start
    w = Writer(db)
    w.put(make_record(id=tid, t_wall=1_790_000_000.5))  # the writer's INSERT OR REPLACE of an existing id
    w.close()
    assert edits() == {"turns": 1, "scrapes": 0}
    _sql(db, "UPDATE turns SET ttft_s = 1 WHERE rowid IN (1, 2)", "DELETE FROM turns WHERE rowid = 3",
         "UPDATE scrapes SET error = NULL")
    assert edits() == {"turns": 4, "scrapes": 1}


def test_vacuum_rebuilds(db, unsampled):
    """VACUUM may renumber the rowids of a table without an INTEGER PRIMARY KEY, and fires no trigger: it
    changes the schema version, which keys the cache."""
    _sql(db, "DELETE FROM turns WHERE rowid % 5 = 1")
    assert_same(db, expect="build")
    _sql(db, "VACUUM")
    assert_same(db, expect="build")
    assert_same(db, expect="hit")


def test_a_database_without_the_edit_counter_is_read_from_sqlite(db):
    """A database from before migration 015 reached through a connection that did not upgrade it: the
    cache cannot know whether stored rows changed, so it serves nothing and says why."""
    assert_same(db, expect="build")
    _sql(db, *[f"DROP TRIGGER {t}_edit_{e}" for t in ("turns", "scrapes") for e in ("update", "delete")],
         "DROP TABLE table_edits", "DELETE FROM _migrations WHERE name = '015_table_edits'")
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)  # not connect(): that would upgrade it
    try:
        def report(cache):
            data = SQLiteSource(conn, cache=cache).load(Window(), REPORT_COLUMNS, server=True, context=True)
            return orjson.dumps(build_report(data, source="db"), option=orjson.OPT_SERIALIZE_NUMPY)

        assert report(True) == report(False)
        assert column_cache.last_status.startswith("unusable: ") and "edit counter" in column_cache.last_status
        assert column_cache.last_rows_status.startswith("unusable: ")
    finally:
        conn.close()
    assert_same(db, expect="build")  # connect() upgrades it (migration 015 again): cached as before


def test_newest_row_replaced_in_its_rowid_rebuilds(db, unsampled):
    """The newest row deleted and another inserted: SQLite hands out the same rowid again, and the
    count and the maximum rowid are as before."""
    assert_same(db, expect="build")
    (last,) = sqlite3.connect(db).execute("SELECT max(rowid) FROM turns").fetchone()
    _sql(db, "DELETE FROM turns WHERE rowid = (SELECT max(rowid) FROM turns)")
    w = Writer(db)
    w.put(make_record(t_wall=1_790_000_000.5, label="old", ttft_s=9.0))
    w.close()
    assert sqlite3.connect(db).execute("SELECT max(rowid) FROM turns").fetchone() == (last,)
    assert_same(db, expect="build")


def test_turn_rewritten_by_insert_or_replace(db, unsampled):
    """The store's INSERT OR REPLACE of an id that exists: a delete (its DELETE trigger fires because the
    store's connections turn recursive_triggers on) and an insert at a new rowid, which alone would look
    like an append."""
    assert_same(db, expect="build")
    (tid,) = sqlite3.connect(db).execute("SELECT id FROM turns WHERE rowid = 10").fetchone()
    w = Writer(db)
    w.put(make_record(id=tid, t_wall=1_790_000_001.0, label="new", decode_tps=1.0))
    w.close()
    assert_same(db, expect="build")


def test_replaced_database_file_rebuilds(db, tmp_path):
    assert_same(db, expect="build")
    other = tmp_path / "other.db"
    write_turns(other, 400, seed=9)
    for suffix in ("-wal", "-shm"):
        Path(str(db) + suffix).unlink(missing_ok=True)
    os.replace(other, db)
    assert_same(db, expect="build")
    # and a copy written over the same file (same inode): the rows tell
    third = tmp_path / "third.db"
    write_turns(third, 400, seed=10)
    shutil.copyfile(third, db)
    assert_same(db, expect="build")


def test_schema_change_rebuilds(db, monkeypatch):
    from specproxy.store import db as store

    assert_same(db, expect="build")
    _sql(db, "ALTER TABLE turns ADD COLUMN extra REAL")
    assert_same(db, expect="build")
    _sql(db, "CREATE INDEX idx_turns_outcome ON turns(outcome)")
    assert_same(db, expect="build")
    # a migration this version knows (one it does not know is refused: test_cli_db.py)
    monkeypatch.setattr(store, "MIGRATIONS", [*store.MIGRATIONS, ("999_future", lambda db: None)])
    _sql(db, "INSERT INTO _migrations VALUES ('999_future', 0)")
    assert_same(db, expect="build")


def _segment_files(db: Path) -> list[Path]:
    return sorted(p for p in column_cache.cache_dir(db).glob("seg-*/*.npy"))


@pytest.mark.parametrize("damage", ["truncate", "extend", "header", "flip", "delete", "empty", "manifest",
                                    "segment_dir"])
def test_damaged_cache_rebuilds(db, damage):
    """Size and header are checked against the manifest; the bytes of a value only where a sampled row
    lands (here the last row's, always sampled): segments are never rewritten, so no checksum."""
    assert_same(db, expect="build")
    cdir = column_cache.cache_dir(db)
    target = next(p for p in _segment_files(db) if p.name == "decode_tps.npy")
    if damage == "truncate":
        data = target.read_bytes()
        target.write_bytes(data[: len(data) // 2])
    elif damage == "extend":
        target.write_bytes(target.read_bytes() + bytes(8))
    elif damage == "header":  # the same size, another shape: the data would be read off by one row
        data = target.read_bytes()
        assert b"(400,)" in data
        target.write_bytes(data.replace(b"(400,)", b"(399,)", 1))
    elif damage == "flip":  # the last row's prompt_tokens (never NULL here): a sampled row differs
        target = target.with_name("prompt_tokens.npy")
        data = bytearray(target.read_bytes())
        assert not np.isnan(np.frombuffer(bytes(data[-8:]), dtype=np.float64)[0])
        data[-3] ^= 0x40
        target.write_bytes(bytes(data))
    elif damage == "delete":
        target.unlink()
    elif damage == "empty":
        target.write_bytes(b"")
    elif damage == "manifest":
        (cdir / "manifest.json").write_text('{"format": 2, "tables": {"turns": {"key": {"format": 1}, "segm')
    elif damage == "segment_dir":
        shutil.rmtree(target.parent)
    assert_same(db, expect="build")
    assert_same(db, expect="hit")


def test_a_warm_load_maps_the_files_instead_of_copying_them(db):
    """The numeric columns of a one-segment cache are the files mapped read-only: no read, no second copy
    in memory (and the analysis never writes into a loaded column: the reports above would raise)."""
    assert_same(db, expect="build")
    conn = connect(db, readonly=True)
    try:
        cols = column_cache.load_columns(conn, NUMERIC, ("t_wall", "decode_tps"), ("label",))
    finally:
        conn.close()
    assert column_cache.last_status == "hit"
    for a in (cols.rowid, cols.num["decode_tps"]):
        assert not a.flags.writeable and not a.flags.owndata
        assert isinstance(a.base.obj, mmap.mmap)  # a memoryview of the mapping


def test_crashed_writer_leaves_nothing_that_counts(db, monkeypatch):
    """A writer that dies half-way (here: while writing a column file's header) leaves a tmp- directory and
    the old manifest; readers go on as if it had never started."""
    assert_same(db, expect="build")
    write_turns(db, 50, seed=5)
    calls = {"n": 0}
    real = column_segments._header

    def dying(dtype, rows):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt  # the process is killed mid-write
        return real(dtype, rows)

    monkeypatch.setattr(column_segments, "_header", dying)
    with pytest.raises(KeyboardInterrupt):
        report_json(db, True)
    monkeypatch.undo()
    # the kill happened inside a tmp- directory (removed on the way out here; a SIGKILL would leave it)
    (column_cache.cache_dir(db) / "tmp-123-abc").mkdir()
    (column_cache.cache_dir(db) / "tmp-123-abc" / "t_wall.npy").write_bytes(b"\x93NUMPY half")
    assert_same(db, expect="append")
    assert_same(db, expect="hit")


def test_unwritable_cache_location_still_reports(db, monkeypatch):
    column_cache.cache_dir(db).write_text("not a directory")  # mkdir fails: no cache, no error
    assert_same(db, expect="build (not saved)")
    assert column_cache.cache_dir(db).read_text() == "not a directory"


def test_read_only_directory_still_reports(db, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    assert_same(db, expect="build")
    write_turns(db, 20, seed=6)
    monkeypatch.setattr(column_cache, "write_segment", refuse)
    assert_same(db, expect="append (not saved)")
    monkeypatch.undo()
    assert_same(db, expect="append")


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="root writes anywhere")
def test_read_only_directory_for_real(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    db = d / "turns.db"
    write_turns(db, 100, seed=7)
    _sql(db, "PRAGMA wal_checkpoint(TRUNCATE)", "PRAGMA journal_mode=DELETE")
    d.chmod(0o555)
    try:
        assert report_json(db, True) == report_json(db, False)
        assert not column_cache.cache_dir(db).exists()
    finally:
        d.chmod(0o755)


def test_empty_and_foreign_databases(tmp_path):
    db = tmp_path / "empty.db"
    Writer(db).close()
    assert_same(db)
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE x (a)").connection.commit()
    with pytest.raises(Exception, match="not a specproxy database"):
        load_turns(other, cache=True, columns=REPORT_COLUMNS)


def test_compare_from_the_cache_equals_sqlite(db):
    write_turns(db, 300, seed=8, t0=1_790_010_000.0)
    for cache in (True, True):
        conn = connect(db, readonly=True)
        try:
            a, b = Arm("old", label="old"), Arm("new", label="new")
            c, d = Arm("@", until=1_790_001_000.0), Arm("@@", since=1_790_010_000.0)

            def three(store):
                arm = {x: store.load(x.window, COMPARE_COLUMNS) for x in (a, b, c, d)}
                return (compare(a, b, arm[a], arm[b], seed=3), negative_control_report(a, arm[a], seed=3),
                        compare(c, d, arm[c], arm[d]))

            got, want = three(SQLiteSource(conn, cache=cache)), three(SQLiteSource(conn))
        finally:
            conn.close()
        assert orjson.dumps(got, option=orjson.OPT_SERIALIZE_NUMPY) == orjson.dumps(want, option=orjson.OPT_SERIALIZE_NUMPY)


@pytest.fixture
def in_ranges(monkeypatch):
    """A build or append of a few hundred rows read as a month's is: in ranges of 37 rowids, each appended to
    the new segment's files as it is read."""
    if not column_cache.column_reader.NATIVE:
        pytest.skip("the ranges are read by the C reader")
    monkeypatch.setattr(column_cache, "_SPLIT_ROWS", 10)
    monkeypatch.setattr(column_cache, "_CHUNK_ROWS", 37)


def _segment_dirs(db: Path) -> set[str]:
    return {p.name for p in column_cache.cache_dir(db).iterdir() if p.name.startswith("seg-")}


def test_a_build_in_ranges_is_one_segment_and_the_same_turns(db, in_ranges, monkeypatch):
    reads = []
    native = column_cache.read_native
    monkeypatch.setattr(column_cache, "read_native", lambda *a: reads.append(a[2]) or native(*a))
    assert_same(db, expect="build")
    assert len(reads) >= 10  # 400 rows in ranges of 37 rowids
    segments = _manifest(db)["turns"]["segments"]
    assert len(segments) == 1 and segments[0]["rows"] == 400
    assert _segment_dirs(db) == {segments[0]["dir"]}  # one directory: the ranges were never segments of their own
    assert_turns_equal(db)
    write_turns(db, 150, seed=2, t0=1_790_000_500.0)  # an append of more than _SPLIT_ROWS: in ranges too
    assert_same(db, expect="append")
    assert 1 < len(_manifest(db)["turns"]["segments"]) <= column_cache.MAX_SEGMENTS
    assert_turns_equal(db)
    counts = []
    for seed in range(3, 3 + column_cache.MAX_SEGMENTS):  # past MAX_SEGMENTS: all merged on disk into one
        write_turns(db, 150, seed=seed, t0=1_790_002_000.0 + seed)
        assert_same(db, expect="append")
        counts.append(len(_manifest(db)["turns"]["segments"]))
    assert max(counts) == column_cache.MAX_SEGMENTS and 1 in counts
    assert len(_segment_dirs(db)) == counts[-1]
    assert_same(db, expect="hit")
    assert_turns_equal(db)


def test_a_range_read_in_another_state_is_read_again_whole(db, in_ranges, monkeypatch):
    """The edit counter a range saw is not the key's (an edit between the reads): no segment of the ranges
    is kept, and the rows are read whole on the checking connection, as for a small build."""
    native = column_cache.read_native
    calls = []

    def edited_meanwhile(*a):
        calls.append(1)
        edits, got = native(*a)
        return (edits + 1 if len(calls) == 3 else edits), got

    monkeypatch.setattr(column_cache, "read_native", edited_meanwhile)
    assert_same(db, expect="build")
    assert len(calls) >= 3
    segments = _manifest(db)["turns"]["segments"]
    assert len(segments) == 1 and _segment_dirs(db) == {segments[0]["dir"]}
    assert_turns_equal(db)


def _lock_is_held(db: Path) -> bool:
    fd = os.open(column_cache.cache_dir(db) / "build.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_a_build_holds_the_cache_directorys_lock(db, in_ranges, monkeypatch):
    """While a build reads its ranges another process cannot take the build lock (it waits, then finds the
    cache current): one builder at a time, where two did the work twice and one could remove the segments
    the other was about to name."""
    native = column_cache.read_native
    held = []
    monkeypatch.setattr(column_cache, "read_native", lambda *a: held.append(_lock_is_held(db)) or native(*a))
    assert_same(db, expect="build")
    assert len(held) >= 10 and all(held)
    assert not _lock_is_held(db)  # let go with the build
    monkeypatch.undo()
    write_turns(db, 20, seed=8)
    assert_same(db, expect="append")
    assert_same(db, expect="hit")


def test_a_current_cache_is_read_while_another_holds_the_lock(db):
    """Readers of a current cache never wait for the lock: a report is served while it is held."""
    assert_same(db, expect="build")
    fd = os.open(column_cache.cache_dir(db) / "build.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        got = []
        reader = threading.Thread(target=lambda: got.append(report_json(db, True)) or got.append(column_cache.last_status))
        reader.start()
        reader.join(timeout=60)  # a reader that waited for the lock would still be waiting here
        assert not reader.is_alive() and got[1] == "hit"
    finally:
        os.close(fd)
        reader.join()
