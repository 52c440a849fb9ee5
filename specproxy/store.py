"""SQLite storage: named migrations, one writer thread, and reads for the reports.

Why one writer thread fed by a bounded queue: the proxy must never wait on the database. ``put`` is a
non-blocking enqueue; when the queue is full (the disk is slow, the file is locked by someone else)
the record is dropped and counted, never the traffic. The writer batches inserts into one transaction
per batch, retries a batch the database refused (locked, full disk) until it is written, and writes
row by row when one record of a batch is bad, so one odd string cannot cost the others.
"""

from __future__ import annotations

import queue
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from operator import attrgetter
from pathlib import Path
from typing import Any

import sqlite_utils

from .errors import StoreError
from .record import FIELD_NAMES, Record
from .retention import ScrapeRetention

__all__ = ["MIGRATIONS", "Writer", "check_schema", "connect", "migrate", "open_existing", "open_store"]


def _sqlite_type(annotation: str) -> type:
    if "bool" in annotation or annotation.startswith("int"):
        return int
    if annotation.startswith("float"):
        return float
    return str


TURN_COLUMNS: dict[str, type] = {f.name: _sqlite_type(str(f.type)) for f in fields(Record)}


# Columns that later migrations add: the first migration must create the table as it was then, so
# that every database, old or new, passes through the same steps.
_ADDED_LATER = {"content_class"}


def _m001_turns(db: sqlite_utils.Database) -> None:
    db["turns"].create({k: v for k, v in TURN_COLUMNS.items() if k not in _ADDED_LATER}, pk="id")
    db["turns"].create_index(["t_wall"])
    db["turns"].create_index(["label"])


def _m002_scrapes(db: sqlite_utils.Database) -> None:
    db["scrapes"].create(
        {
            "id": int,
            "t_wall": float,
            "t_mono": float,
            "instance_id": str,
            "server_kind": str,
            "requests_running": float,
            "requests_waiting": float,
            "generation_tokens_total": float,
            "prompt_tokens_total": float,
            "spec_drafts_total": float,
            "spec_draft_tokens_total": float,
            "spec_accepted_tokens_total": float,
            "spec_accept_length": float,
            "spec_accept_rate": float,
            "raw": str,
        },
        pk="id",
    )
    db["scrapes"].create_index(["t_wall"])
    db["instances"].create(
        {"instance_id": str, "first_seen": float, "last_seen": float, "detail": str}, pk="instance_id"
    )


def _m003_turn_counters(db: sqlite_utils.Database) -> None:
    db["scrapes"].add_column("error", str)
    db["turn_counters"].create(
        {
            "turn_id": str,
            "instance_id": str,
            "seconds": float,
            "generated_tokens": float,
            "drafts": float,
            "draft_tokens": float,
            "accepted_tokens": float,
            "mal": float,
            "acceptance_rate": float,
        },
        pk="turn_id",
    )


def _m004_content_class(db: sqlite_utils.Database) -> None:
    db["turns"].add_column("content_class", str)


# Named and ordered; each runs once, in its own transaction, and is recorded in _migrations.
MIGRATIONS: list[tuple[str, Callable[[sqlite_utils.Database], None]]] = [
    ("001_turns", _m001_turns),
    ("002_scrapes_and_instances", _m002_scrapes),
    ("003_turn_counters_and_scrape_errors", _m003_turn_counters),
    ("004_content_class", _m004_content_class),
]


def connect(path: str | Path, *, readonly: bool = False, existing: bool | None = None) -> sqlite3.Connection:
    """Open the database (WAL, a busy timeout); raise StoreError with a clear reason when it can't.

    ``existing`` (the default when ``readonly``): the file must already be a specproxy database of a
    schema this version knows; it is never created. Read commands and ``prune`` open it so, and every
    way a file can be the wrong one (missing, a directory, empty, not SQLite, another program's, written
    by a newer or older specproxy) is said here as one line naming the path, not left to the first query.
    """
    p = Path(path)
    existing = readonly if existing is None else existing
    try:
        if existing:
            _check_file(p)
            if readonly:
                conn = sqlite3.connect(f"file:{p}?mode=ro", uri=True, check_same_thread=False)
            else:  # never creates the file; transactions are the caller's, as the writer's are
                conn = sqlite3.connect(f"file:{p}?mode=rw", uri=True, check_same_thread=False, isolation_level=None)
        else:
            if p.parent and not p.parent.exists():
                raise StoreError(f"cannot create database {p}: directory {p.parent} does not exist")
            conn = sqlite3.connect(p, check_same_thread=False, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA busy_timeout=2000")
    except sqlite3.Error as exc:
        raise StoreError(f"{p}: cannot open database: {exc}") from None
    if existing:
        try:
            check_schema(conn, p)
        except BaseException:
            conn.close()
            raise
    return conn


def _check_file(p: Path) -> None:
    """What the file system alone can tell; SQLite would create a missing file, and calls a directory
    a "disk I/O error"."""
    if p.is_dir():
        raise StoreError(f"{p}: is a directory, not a database file")
    if not p.exists():
        raise StoreError(f"{p}: database does not exist (run `specproxy serve` or `specproxy demo` first)")


def check_schema(conn: sqlite3.Connection, p: Path) -> None:
    """Raise StoreError unless ``conn`` holds a specproxy database whose migrations are exactly ours."""
    try:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        done = ({row[0] for row in conn.execute("SELECT name FROM _migrations")}
                if "_migrations" in tables else set())
    except sqlite3.DatabaseError as exc:
        if getattr(exc, "sqlite_errorcode", 0) & 0xFF == _NOTADB:  # junk bytes: "file is not a database"
            raise StoreError(f"{p}: not an SQLite database ({exc})") from None
        raise StoreError(f"{p}: cannot read database: {exc}") from None
    if "turns" not in tables or not done:
        what = "an empty file (0 bytes)" if _size(p) == 0 else (
            "an SQLite database without a turns table" if "turns" not in tables else "a turns table without _migrations")
        raise StoreError(f"{p}: not a specproxy database: {what}")
    known = [name for name, _ in MIGRATIONS]
    newer = sorted(done - set(known))
    if newer:
        raise StoreError(f"{p}: written by a newer specproxy (schema step {newer[0]} is unknown here): upgrade "
                         f"specproxy to read it")
    missing = [name for name in known if name not in done]
    if missing:
        raise StoreError(f"{p}: written by an older specproxy (schema step {missing[0]} not applied): "
                         f"`specproxy serve --db {p}` upgrades it in place")


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return -1


_NOTADB = 26
# SQLite's primary result codes that say the file (not the query) is the problem
# (PERM, BUSY, LOCKED, READONLY, IOERR, CORRUPT, FULL, CANTOPEN, NOTADB)
_FILE_ERRORS = frozenset({3, 5, 6, 8, 10, 11, 13, 14, _NOTADB})


@contextmanager
def open_existing(path: str | Path, *, readonly: bool = True) -> Iterator[sqlite3.Connection]:
    """A connection to an existing specproxy database (never created), closed on exit. A file that fails
    part-way (a corrupt page, a lock held too long) is a StoreError naming the path, not a traceback;
    any other SQLite error is a bug and keeps its traceback."""
    conn = connect(path, readonly=readonly, existing=True)
    try:
        yield conn
    except sqlite3.DatabaseError as exc:
        if (getattr(exc, "sqlite_errorcode", 0) & 0xFF) not in _FILE_ERRORS:
            raise
        raise StoreError(f"{path}: cannot {'read' if readonly else 'write'} database: {exc}") from None
    finally:
        conn.close()


def migrate(conn: sqlite3.Connection) -> list[str]:
    """Apply the migrations not yet applied; return their names."""
    db = sqlite_utils.Database(conn)
    conn.execute("CREATE TABLE IF NOT EXISTS _migrations (name TEXT PRIMARY KEY, applied_at REAL)")
    done = {row[0] for row in conn.execute("SELECT name FROM _migrations")}
    applied = []
    for name, step in MIGRATIONS:
        if name in done:
            continue
        conn.execute("BEGIN IMMEDIATE")
        try:
            step(db)
            conn.execute("INSERT INTO _migrations VALUES (?, ?)", (name, time.time()))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        applied.append(name)
    return applied


def open_store(path: str | Path) -> sqlite3.Connection:
    """Open for writing and migrate; a path that cannot be written is a StoreError, said at start-up."""
    conn = connect(path)
    try:
        migrate(conn)
    except sqlite3.Error as exc:
        conn.close()
        raise StoreError(f"cannot write database {path}: {exc}") from None
    return conn


_SURROGATES = re.compile("[\ud800-\udfff]")


def _clean(value: Any) -> Any:
    """SQLite text must be UTF-8: lone surrogates (from hostile JSON) become U+FFFD, not an error."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return _SURROGATES.sub("\ufffd", value)
    elif isinstance(value, bool):
        return int(value)
    return value


def record_row(record: Record) -> tuple:
    """The row of a record, cleaned for SQLite (the slow path: ``Writer`` first tries ``_raw_row``)."""
    return tuple(_clean(getattr(record, name)) for name in FIELD_NAMES)


# the row as it is, in C; SQLite takes a bool as an integer, and refuses a lone surrogate, which sends the
# batch to the cleaned one-by-one path
_raw_row = attrgetter(*FIELD_NAMES)


_INSERT_TURN = f"INSERT OR REPLACE INTO turns ({', '.join(FIELD_NAMES)}) VALUES ({', '.join('?' * len(FIELD_NAMES))})"


LINGER_BATCH = 32  # records: enough to make a commit cheap per row, few enough to bind in well under 1 ms


class Writer:
    """The single writer thread. ``put`` never blocks; ``close`` drains what was queued."""

    def __init__(self, path: str | Path, *, queue_size: int = 10000, batch_size: int = 1000,
                 linger_s: float = 0.25, scrape_retention_days: float = 0.0) -> None:
        """``linger_s``: after the first record of a batch, wait this long for more. Records come a few at a
        time (one measuring batch), and a commit costs more than a row: at 64 streams (~30 turns/s) the
        writer thread cost 1.6 µs per relayed chunk lingering 50 ms and 0.8 lingering 250 ms
        (scripts/bench_overhead.py). A row appears in the database at most that much later; ``close``
        does not wait for it. It stops waiting once ``LINGER_BATCH`` records are in: a larger batch holds
        the interpreter lock longer while its rows are bound, which the relay feels as latency.

        ``scrape_retention_days``: scrapes older than this are deleted at start-up and hourly, a chunk at a
        time between batches (retention.py); 0 keeps them all."""
        self.path = Path(path)
        self._linger_s = linger_s
        self._conn = open_store(self.path)  # fail at start-up, not at the first turn
        # SimpleQueue: a put is one C call (queue.Queue's is Python with a Condition: ~5 µs per record on
        # the event loop); the bound is checked before each put (exact while one thread puts, as the loop does)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._queue_size = queue_size
        self._batch_size = batch_size
        self._stop = threading.Event()
        self.retention = ScrapeRetention(scrape_retention_days)
        self._thread = threading.Thread(target=self._run, name="specproxy-writer", daemon=True)
        self.written = 0
        self.dropped = 0
        self.retries = 0
        self.bad_rows = 0
        self.last_error: str | None = None
        self._thread.start()

    def put(self, item: Record | tuple[str, tuple]) -> bool:
        """Enqueue a Record (or a ``(sql, params)`` pair); False (and counted) when the queue is full."""
        if self._stop.is_set():  # closing: what comes after close() is not waited for
            self.dropped += 1
            return False
        if self._queue.qsize() >= self._queue_size:
            self.dropped += 1
            return False
        self._queue.put(item)
        return True

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    def close(self, timeout: float = 30.0) -> None:
        """Stop after writing everything queued so far (bounded by ``timeout``)."""
        self._stop.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._conn.close()

    def _run(self) -> None:
        pending: list = []
        while True:
            if not pending:
                self.retention.run_if_due(self._conn)  # here: never while a batch waits
                try:
                    pending.append(self._queue.get(timeout=0.1))
                except queue.Empty:
                    # only an empty queue ends the thread: CPython's timed SimpleQueue.get can raise Empty
                    # with records queued (its wait times out as a put lands), and returning then lost
                    # every record put just before close() (seen in the test suite, 2026-11-30)
                    if self._stop.is_set() and self._queue.empty():
                        return
                    continue
            deadline = time.monotonic() + self._linger_s
            while len(pending) < self._batch_size:
                try:
                    left = deadline - time.monotonic()
                    if left > 0 and len(pending) < LINGER_BATCH and not self._stop.is_set():
                        pending.append(self._queue.get(timeout=left))
                    else:
                        pending.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if self._write(pending):
                pending = []
            elif self._stop.is_set() and self._stop_deadline_passed():
                self.dropped += len(pending)
                return
            else:
                self.retries += 1
                self._stop.wait(0.2)  # the database refused (locked, full disk): try the batch again

    _stop_since: float | None = None

    def _stop_deadline_passed(self) -> bool:
        now = time.monotonic()
        if self._stop_since is None:
            self._stop_since = now
        return now - self._stop_since > 5.0

    def _write(self, items: list) -> bool:
        records = [i for i in items if isinstance(i, Record)]
        other = [i for i in items if not isinstance(i, Record)]
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.executemany(_INSERT_TURN, map(_raw_row, records))
                for sql, params in other:
                    self._conn.execute(sql, params)
                self._conn.execute("COMMIT")
            except sqlite3.OperationalError:
                self._rollback()
                raise
            except Exception:  # e.g. a lone surrogate from hostile JSON: clean every row, skip what still fails
                self._rollback()
                self._write_one_by_one([record_row(r) for r in records], other)
            self.written += len(records)
            return True
        except sqlite3.OperationalError as exc:  # locked, busy, disk full, read-only: transient
            self.last_error = str(exc)
            return False

    def _rollback(self) -> None:
        """Roll back if a transaction is still open: after SQLITE_FULL SQLite has already rolled
        back, and a failing ROLLBACK must not hide the error that caused it."""
        if self._conn.in_transaction:
            try:
                self._conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass

    def _write_one_by_one(self, turns: Iterable[tuple], other: Iterable[tuple[str, tuple]]) -> None:
        for row in turns:
            try:
                self._conn.execute(_INSERT_TURN, row)
            except sqlite3.OperationalError:
                raise
            except Exception as exc:
                self.bad_rows += 1
                self.last_error = f"bad row skipped: {type(exc).__name__}"
        for sql, params in other:
            try:
                self._conn.execute(sql, params)
            except sqlite3.OperationalError:
                raise
            except Exception:
                self.bad_rows += 1
