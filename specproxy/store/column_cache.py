"""A columnar cache of the ``turns`` and ``scrapes`` tables beside the database, checked against it on
every load.

Why: a report over a million turns spent ~9 s turning SQLite rows into Python objects and those into
numpy columns (and 1 s more for its 121k scrapes); the same columns mapped from one ``.npy`` file each
take a fraction of a second. The cache is derived data and must never change a number, so every load
checks it against the database and, whenever it cannot vouch for it, the caller reads SQLite as before.

Where: ``<db>.cache/`` beside the database file (``specproxy.db`` -> ``specproxy.db.cache/``):
``manifest.json`` (one entry per table) and immutable segment directories ``seg-*/``, each with one
``.npy`` per column of one table (text columns as int32 codes into a dictionary kept in the manifest).
Deleting the directory is always safe; ``specproxy report --no-cache`` bypasses it. One implementation
serves both tables (``Table``): segments and manifest (``column_segments.py``), checks and the incremental
read.

Why incremental: specproxy only ever inserts rows without naming their rowid, so SQLite gives each a
rowid above every stored one, and the rows with a rowid above the cached maximum are the new ones: they
are read, appended as a new segment, and segments are merged when there are more than ``MAX_SEGMENTS``.
Every other change to a stored row (an UPDATE, a DELETE, and the delete an ``INSERT OR REPLACE`` of an
existing id does, which fires the DELETE trigger because ``db.connect`` turns ``recursive_triggers`` on)
is counted by the database itself: migration 015's triggers add one to the table's row of
``table_edits``, in the same transaction as the change.

What keys it, checked on every load inside one read transaction (none of it scans the table):

* the cache format, the table and its cached column names, the database file's device and inode (a
  file put in its place is another inode), its ``store_id``, ``PRAGMA schema_version`` (which VACUUM
  also bumps), the table's SQL and the applied migrations (a migration or any schema change rebuilds);
* the table's edit counter: any edit of a stored row since the cache was written rebuilds. A database
  without the counter (one from before migration 015 reached through a connection that did not
  upgrade it) is not served from the cache at all: the SQL path, ``last_status`` says why;
* the cached rows are still there: the rowids ascend up to the manifest's maximum, the table's maximum
  rowid is not below it, and the first, the last and ``SAMPLED_ROWS`` random cached rows equal their
  database rows in every column loaded (a file copied over the database in place, rowids renumbered);
* every file's size and ``.npy`` header (shape, dtype) equal the manifest's and the segment's row count.

Why no checksum of the files: ``column_segments.py`` (the files, shared with ``pg_cache.py``). CRC-32 over
every file cost a full read and a copy of every column (0.43 s and the columns' size again in memory at
1M turns); the files are mapped read-only, and the pages the analysis touches are the only ones read.

A directory that cannot be written (read-only database directory) means no cache, never an error. What
the counter cannot see: another program's ``INSERT OR REPLACE`` of an existing row on a connection
without ``recursive_triggers``, changes made while the triggers were dropped (dropping them changes the schema
version: a rebuild, but a change made in between and the triggers put back is missed), a row inserted
with an explicit rowid below the cached maximum (nothing in specproxy does so), and a backup of the same
database restored in place with as many rows and the same counter: delete ``DB.cache/`` after such edits.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import shutil
import sqlite3
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specproxy.store import column_reader
from specproxy.store.column_reader import Unsupported, read_native, read_reference
from specproxy.store.column_segments import (FORMAT, Invalid, SegmentWriter, Table, coded, load_segment, merge,
                                             read_manifest, write_manifest, write_merged, write_segment)
from specproxy.store.turns import decode

__all__ = ["CACHED_TEXT", "Columns", "Table", "cache_dir", "db_file", "load_columns", "load_rows"]

log = logging.getLogger("specproxy.cache")

# text columns with few distinct values: stored as codes into a dictionary ("id" is not cached)
CACHED_TEXT = ("outcome", "label", "instance_id", "tokenizer", "content_class", "path", "api", "client", "session",
               "prefix_break_part", "turn_diff", "tool_names", "model", "tenant", "proxy_name")
MAX_SEGMENTS = 8
SAMPLED_ROWS = 16
# a cold build of at least this many rows is read on every CPU (two here), in consecutive rowid ranges
_SPLIT_ROWS = 200_000
# ... in rowid ranges of at most this many rowids, each appended to the new segment's files as soon as it is
# read: a month's build holds two ranges in memory (with the C reader's buffers,
# which double as they fill), not the table: 1.8 GB peak at 10M turns, 2.2 GB with ranges of 1M
_CHUNK_ROWS = 500_000


@dataclass
class Columns:
    """Every turn, in rowid order: ``rowid`` int64, ``num`` float64 arrays, ``codes`` the text columns as
    (int32 codes, values), -1 for NULL: handed over as stored, never decoded to objects here."""

    rowid: np.ndarray
    num: dict[str, np.ndarray]
    codes: dict[str, tuple[np.ndarray, list]]


def _turns(numeric: tuple[str, ...]) -> Table:
    return Table("turns", numeric, CACHED_TEXT)


def cache_dir(db_path: str | Path) -> Path:
    p = Path(db_path)
    return p.with_name(p.name + ".cache")


def db_file(conn: sqlite3.Connection) -> Path | None:
    """The file behind the connection's main database (None for an in-memory or temporary one)."""
    for _, name, path in conn.execute("PRAGMA database_list"):
        if name == "main":
            return Path(path) if path else None
    return None


class _NoCounter(Exception):
    """The database keeps no edit counter: the cache cannot know its rows are current (read SQLite)."""


# --- the key --------------------------------------------------------------------------------------


def _one(conn: sqlite3.Connection, sql: str, params: tuple = ()) -> Any:
    """The first column of the first row, None when there is no row or no such table."""
    try:
        row = conn.execute(sql, params).fetchone()
    except sqlite3.OperationalError:
        return None
    return None if row is None else row[0]


def _key(conn: sqlite3.Connection, db: Path, table: Table) -> dict:
    edits = _one(conn, "SELECT edits FROM table_edits WHERE name = ?", (table.name,))
    if edits is None:
        raise _NoCounter(f"no edit counter for {table.name} (table_edits: a database from before migration "
                         "015_table_edits, not upgraded)")
    st = os.stat(db)
    try:
        migrations = [r[0] for r in conn.execute("SELECT name FROM _migrations ORDER BY name")]
    except sqlite3.OperationalError:
        migrations = None
    return {
        "format": FORMAT,
        "table": table.name,
        "numeric": list(table.numeric),
        "text": list(table.text),
        "dev": st.st_dev,
        "ino": st.st_ino,
        "store_id": _one(conn, "SELECT value FROM store_meta WHERE key = 'store_id'"),
        "schema_version": conn.execute("PRAGMA schema_version").fetchone()[0],
        "sql": _one(conn, "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table.name,)),
        "migrations": migrations,
        "edits": edits,
    }


# --- reading rows from SQLite -------------------------------------------------------------------------


def _fetch(conn: sqlite3.Connection, db: Path, table: Table, after: int,
           edits: int) -> tuple[dict[str, np.ndarray], dict]:
    """Rows with rowid > ``after``, rowid order: arrays (rowid, numeric, text codes) and dictionaries.

    Read by the C reader (``column_reader``) when it is built, the range split across the CPUs (a
    month's cold build is minutes of SQLite's own row decoding on one core), each part on its own
    connection in its own read transaction, guarded by the edit counter: when a part saw another count
    than ``edits`` (this connection's), or the reader refuses a value, the rows are read here instead.
    Rows added after this connection's snapshot (above its max rowid) are left for the next load."""
    names, kinds, sql, guard = _reading(table)
    lo, hi = _new_rowids(conn, table, after)
    if lo is None:
        return _columns(names, kinds, read_reference(conn, sql, (after, after), kinds))
    if column_reader.NATIVE:
        parts = _ranges(lo - 1, hi, _workers() if hi - lo >= _SPLIT_ROWS else 1)
        try:
            with ThreadPoolExecutor(len(parts)) as pool:
                got = list(pool.map(lambda r: read_native(db, sql, r, kinds, guard), parts))
            if all(g == edits for g, _ in got):
                loaded = [dict(zip(names, arrays)) for _, (arrays, _) in got]
                segs = [{"dicts": dict(zip(names, dicts))} for _, (_, dicts) in got]
                return merge(table.text, segs, loaded)
            log.info("column cache of %s: %s changed while read; read again on one connection", db, table.name)
        except (Unsupported, RuntimeError) as exc:
            log.info("column cache of %s: the C reader cannot read %s (%s); the sqlite3 module reads it",
                     db, table.name, exc)
    return _columns(names, kinds, read_reference(conn, sql, (after, hi), kinds))


def _build_in_chunks(conn: sqlite3.Connection, db: Path, cdir: Path, table: Table, after: int, key: dict,
                     segs: list[dict], previous: set) -> list[dict] | None:
    """Many new rows (at least ``_SPLIT_ROWS``): read by the C reader in rowid ranges of ``_CHUNK_ROWS``, two
    at once, each range's columns appended to one new segment as soon as it is read and let go of (past
    ``MAX_SEGMENTS``, every segment merged into one); the manifest written. The table's segments now, or
    None when this does not apply (few rows, no C reader, a directory that cannot be written) or a range
    saw another edit count than ``key``'s or the reader refused a value: the caller then reads the rows in
    memory (``_fetch``), as for few rows.

    Why: read whole, a month's build held every column of every turn at once, twice while the two CPUs'
    halves were joined (5.8 GB at 10M turns); this holds two ranges."""
    if not column_reader.NATIVE:
        return None
    lo, hi = _new_rowids(conn, table, after)
    if lo is None or hi - lo < _SPLIT_ROWS:
        return None
    try:
        cdir.mkdir(exist_ok=True)
    except OSError:
        return None
    names, kinds, sql, guard = _reading(table)
    ranges = iter(_ranges(lo - 1, hi, -(-(hi - lo + 1) // _CHUNK_ROWS)))
    writer: SegmentWriter | None = None
    try:
        writer = SegmentWriter(cdir, table, names)
        with ThreadPoolExecutor(_workers()) as pool:
            reading = deque(pool.submit(read_native, db, sql, r, kinds, guard)
                            for r in itertools.islice(ranges, _workers()))
            while reading:
                edits, (arrays, dicts) = reading.popleft().result()
                if edits != key["edits"]:
                    raise _Changed
                nxt = next(ranges, None)
                if nxt is not None:
                    reading.append(pool.submit(read_native, db, sql, nxt, kinds, guard))
                writer.add(dict(zip(names, arrays)), dict(zip(names, dicts)))
                del arrays, dicts
        built, writer = writer.close(), None
        if not built["rows"]:
            shutil.rmtree(cdir / built["dir"], ignore_errors=True)
            return None
        every = [*segs, built]
        if len(every) > MAX_SEGMENTS:
            every = [write_merged(cdir, table, every)]
        write_manifest(cdir, table.name, {"key": key, "segments": every}, previous | {built["dir"]})
        return every
    except (_Changed, Unsupported, RuntimeError, OSError) as exc:
        log.info("column cache of %s: %s not built in ranges (%s); read whole", db, table.name,
                 type(exc).__name__ if isinstance(exc, _Changed) else exc)
        if writer is not None:
            writer.abort()
        return None


class _Changed(Exception):
    """A range was read in another state of the table than the key's: the rows are read again whole."""


def _reading(table: Table) -> tuple[tuple[str, ...], str, str, str]:
    """How a range of the table's rows is read: its columns (rowid first), their kinds for the readers,
    the query over ``(a, b]`` of rowids, and the edit counter's query that guards a read."""
    names = ("rowid", *table.numeric, *table.text)
    kinds = "i" + "f" * len(table.numeric) + "t" * len(table.text)
    sql = f"SELECT {', '.join(names)} FROM {table.name} WHERE rowid > ? AND rowid <= ? ORDER BY rowid"
    return names, kinds, sql, f"SELECT edits FROM table_edits WHERE name = '{table.name}'"


def _new_rowids(conn: sqlite3.Connection, table: Table, after: int) -> tuple[int | None, int | None]:
    """The least and greatest rowid above ``after`` (None, None when there is none)."""
    # apart: each is one seek of the rowid b-tree, where asked together SQLite scans every row above ``after``
    # (2 s of a month's cold build)
    lo = conn.execute(f"SELECT min(rowid) FROM {table.name} WHERE rowid > ?", (after,)).fetchone()[0]
    if lo is None:
        return None, None
    return lo, conn.execute(f"SELECT max(rowid) FROM {table.name}").fetchone()[0]


def _columns(names: tuple[str, ...], kinds: str, read: tuple[list, list]) -> tuple[dict[str, np.ndarray], dict]:
    arrays, dicts = read
    return dict(zip(names, arrays)), {n: d for n, d, k in zip(names, dicts, kinds) if k == "t"}


def _ranges(after: int, last: int, k: int) -> list[tuple[int, int]]:
    """``(after, last]`` as k consecutive ``(a, b]`` ranges of about equal length."""
    cuts = [after + (last - after) * i // k for i in range(k + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def _workers() -> int:
    return max(1, min(2, len(os.sched_getaffinity(0))))


# --- the checks ----------------------------------------------------------------------------------


def _same(sql_value, cached: float) -> bool:
    if sql_value is None:
        return bool(np.isnan(cached))
    return float(sql_value) == float(cached)


def _check(conn: sqlite3.Connection, table: Table, arrays: dict[str, np.ndarray], dicts: dict,
           max_rowid: int) -> None:
    """Raise Invalid unless the database still holds the cached rows up to ``max_rowid`` (the edit
    counter in the key vouches for the rows not sampled here)."""
    rowid = arrays["rowid"]
    if len(rowid) > 1 and not np.all(rowid[1:] > rowid[:-1]):
        raise Invalid("rowids not ascending")
    if not len(rowid) or int(rowid[-1]) != max_rowid:
        raise Invalid("the last rowid is not the manifest's")
    top = _one(conn, f"SELECT max(rowid) FROM {table.name}")
    if top is None or top < max_rowid:
        raise Invalid("rows above the database's last")
    # the first, the last and a few random rows, in every loaded column
    rng = np.random.default_rng()
    pos = sorted({0, len(rowid) - 1, *rng.integers(0, len(rowid), SAMPLED_ROWS).tolist()})
    names = [n for n in arrays if n != "rowid"]
    got = conn.execute(
        f"SELECT rowid, {', '.join(names)} FROM {table.name} WHERE rowid IN ({', '.join('?' * len(pos))})",
        [int(rowid[p]) for p in pos]).fetchall()
    if len(got) != len(pos):
        raise Invalid("a sampled row is missing")
    at = {int(rowid[p]): int(p) for p in pos}
    for r in got:
        p = at[r[0]]
        for i, name in enumerate(names):
            if name in table.text:
                code = int(arrays[name][p])
                if not -1 <= code < len(dicts[name]) or r[1 + i] != (None if code < 0 else dicts[name][code]):
                    raise Invalid(f"a sampled row differs in {name}")
            elif not _same(r[1 + i], arrays[name][p]):
                raise Invalid(f"a sampled row differs in {name}")


# --- loading ----------------------------------------------------------------------------------------

last_status = "off"  # what the last load_columns did: hit, append, build, unusable (for tests and benchmarks)
last_rows_status = "off"  # the same for the last load_rows


def _serve(conn: sqlite3.Connection, read: Callable[[Path, Path], tuple[Any, str]]) -> tuple[Any, str]:
    """``read(db, cache directory)`` inside one read transaction (one snapshot for the checks and the new
    rows): its result and status, or None and why the cache cannot serve this connection."""
    try:
        db = db_file(conn)
    except sqlite3.Error:
        return None, "unusable"
    if db is None or not db.is_file():
        return None, "unusable"
    own = not conn.in_transaction
    try:
        if own:
            conn.execute("BEGIN")
        return read(db, cache_dir(db))
    except Exception as exc:  # not a specproxy database, a column missing, odd values: the SQL path says why
        log.debug("column cache unusable: %s", exc)
        return None, f"unusable: {type(exc).__name__}: {exc}"
    finally:
        if own and conn.in_transaction:
            conn.execute("COMMIT")


def load_columns(conn: sqlite3.Connection, numeric: tuple[str, ...], want_num: tuple[str, ...],
                 want_txt: tuple[str, ...]) -> Columns | None:
    """Every turn with these columns, in rowid order, from the cache brought up to date (and saved when
    the cache directory can be written); None when the cache cannot serve them (read SQLite instead).

    ``numeric`` is every numeric column the cache holds (one cache serves every caller); ``want_*``
    are the columns to return, besides ``rowid``.
    """
    global last_status
    last_status = "unusable"
    if not set(want_num) <= set(numeric) or not set(want_txt) <= set(CACHED_TEXT):
        return None
    cols, last_status = _serve(conn, lambda db, cdir: _load_columns(conn, db, cdir, tuple(numeric), want_num,
                                                                     want_txt))
    return cols


def _load_columns(conn, db, cdir, numeric, want_num, want_txt) -> tuple[Columns, str]:
    names = ["rowid", "t_wall", "label", *[n for n in want_num if n != "t_wall"], *[t for t in want_txt if t != "label"]]
    old, old_dicts, status = _load_table(conn, db, cdir, _turns(numeric), names)
    cols = Columns(rowid=old["rowid"], num={n: old[n] for n in names[1:] if n not in CACHED_TEXT},
                   codes={n: coded(old[n], old_dicts[n]) for n in names[1:] if n in CACHED_TEXT})
    return cols, status


def load_rows(conn: sqlite3.Connection, table: Table,
              pick: Callable[[dict[str, np.ndarray]], np.ndarray]) -> tuple[dict, dict] | None:
    """The rows of ``table`` that ``pick`` chooses, from the cache brought up to date: ``pick(numeric)``
    gets the numeric columns of every row in rowid order and returns the indices of the rows wanted, in
    the order wanted. Returns ``(numeric, text)``: every column of the table for those rows, text
    decoded (``None`` for NULL); None when the cache cannot serve them (read SQLite instead)."""
    global last_rows_status

    def read(db: Path, cdir: Path) -> tuple[tuple[dict, dict], str]:
        arrays, dicts, status = _load_table(conn, db, cdir, table, ["rowid", *table.numeric, *table.text])
        idx = pick({n: arrays[n] for n in table.numeric})
        return ({n: arrays[n][idx] for n in table.numeric},
                {n: decode(*coded(arrays[n][idx], dicts[n])) for n in table.text}), status

    got, last_rows_status = _serve(conn, read)
    return got


def _load_table(conn: sqlite3.Connection, db: Path, cdir: Path, table: Table,
                names: list[str]) -> tuple[dict[str, np.ndarray], dict, str]:
    """The table's ``names`` columns (rowid first) and text dictionaries, every row in rowid order, from
    the cache checked and brought up to date (and saved when it can be), and what was done: hit, append,
    build.

    A cache that is current is read as it is; one that needs work is brought up to date by one process at a
    time (``_one_builder``): another that asks meanwhile waits, then finds it current. Two builds at once did
    the work twice, and one could remove the segments the other was about to name."""
    got = _load_table_now(conn, db, cdir, table, names, build=False)
    if got is not None:
        return got
    with _one_builder(cdir):
        return _load_table_now(conn, db, cdir, table, names, build=True)


@contextlib.contextmanager
def _one_builder(cdir: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the cache directory's ``build.lock`` for the block; none where the directory
    cannot be made or written (there is no cache to share there)."""
    try:
        cdir.mkdir(exist_ok=True)
        fd = os.open(cdir / "build.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        fd = None
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # the lock goes with it


def _load_table_now(conn: sqlite3.Connection, db: Path, cdir: Path, table: Table, names: list[str], *,
                    build: bool) -> tuple[dict[str, np.ndarray], dict, str] | None:
    """``_load_table``'s work; without ``build``, None unless the cache is current (a hit)."""
    key = _key(conn, db, table)
    entry = read_manifest(cdir).get(table.name)
    segs: list[dict] = []
    old: dict[str, np.ndarray] | None = None
    old_dicts: dict = {}
    max_rowid = None
    valid = False  # the manifest's entry is this table's now (maybe of no rows)
    if entry is not None and entry.get("key") == key:
        try:
            segs = entry["segments"]
            loaded = [load_segment(cdir, table, s, set(names)) for s in segs]
            if segs:
                old, old_dicts = merge(table.text, segs, loaded)
                max_rowid = max(s["max_rowid"] for s in segs)
                _check(conn, table, old, old_dicts, max_rowid)
            valid = True
        except (Invalid, OSError, KeyError, IndexError, ValueError, TypeError) as exc:
            log.info("column cache of %s (%s) rebuilt: %s", db, table.name, exc)
            segs, old, old_dicts, max_rowid = [], None, {}, None
    after = max_rowid if max_rowid is not None else -(2**63)
    if not build:  # rows to read are read under the lock; else nothing is written: the answer is here
        if _new_rowids(conn, table, after)[0] is not None:
            return None
        if old is None:  # no rows: cached as such, or a table that has none (nothing written either way)
            old, old_dicts = merge(table.text, [{"dicts": {n: [] for n in table.text}}],
                                   [{n: np.empty(0, table.dtype(n)) for n in names}])
        return old, old_dicts, "hit" if valid and segs else "build"
    previous = {s.get("dir") for s in entry["segments"] if isinstance(s, dict)} if entry else set()
    built = _build_in_chunks(conn, db, cdir, table, after, key, segs, previous)
    if built is not None:
        segs = built
        loaded = [load_segment(cdir, table, s, set(names)) for s in segs]
        old, old_dicts = merge(table.text, segs, loaded)
        return old, old_dicts, "append" if max_rowid is not None else "build"
    new, new_dicts = _fetch(conn, db, table, after, key["edits"])
    status = "hit" if segs else "build"
    if len(new["rowid"]):
        status = "append" if segs else "build"
        try:
            _persist(cdir, table, key, segs, new, new_dicts, previous)
        except OSError as exc:  # read-only directory, disk full: no cache, no error
            log.debug("column cache of %s not written: %s", db, exc)
            status += " (not saved)"
        part = {n: new[n] for n in names}
        if old is None:
            old, old_dicts = merge(table.text, [{"dicts": new_dicts}], [part])
        else:
            old, old_dicts = merge(table.text, [{"dicts": old_dicts}, {"dicts": new_dicts}], [old, part])
    elif old is None:  # no rows at all
        old, old_dicts = merge(table.text, [{"dicts": new_dicts}], [{n: new[n] for n in names}])
    return old, old_dicts, status


def _persist(cdir: Path, table: Table, key: dict, segs: list[dict], new: dict[str, np.ndarray], new_dicts: dict,
             previous: set) -> None:
    """Write the new rows as a segment (or, past MAX_SEGMENTS, everything as one) and the manifest, with
    the other tables' entries as the manifest holds them now."""
    cdir.mkdir(exist_ok=True)
    if len(segs) + 1 > MAX_SEGMENTS:
        everything = [load_segment(cdir, table, s, set(new)) for s in segs]
        merged, dicts = merge(table.text, [*segs, {"dicts": new_dicts}], [*everything, new])
        segs = [write_segment(cdir, table, merged, dicts)]
    else:
        segs = [*segs, write_segment(cdir, table, new, new_dicts)]
    write_manifest(cdir, table.name, {"key": key, "segments": segs}, previous)
