"""SQLite storage: named migrations, one writer thread, and reads for the reports.

Why one writer thread fed by a bounded queue: the proxy must never wait on the database. ``put`` is a
non-blocking enqueue; when the queue is full (the disk is slow, the file is locked by someone else)
the record is dropped and counted, never the traffic. The writer writes a record as soon as it is ready,
with whatever else has queued meanwhile, in one transaction (at most one commit per ``COMMIT_GAP_S``);
it retries a batch the database refused (locked, full disk), split so that whatever fits is written
(the longest prefix that commits, found by halving), logs a failure once per cause and counts every
failed attempt, and writes row by row when one record of a batch is bad, so one odd string cannot cost
the others. What it still holds at shutdown after ``STOP_RETRY_S`` of failures is counted as dropped
and said in one line. A record waits at most about ``COMMIT_GAP_S`` plus a commit once it is ready: that
is what a SIGKILL can lose of turns that had ended.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from operator import attrgetter
from pathlib import Path
from typing import Any

from specproxy.errors import StoreError
from specproxy.record import FIELD_NAMES, Record
from specproxy.store.retention import ScrapeRetention
from specproxy.wire.os_thread import name_os_thread

log = logging.getLogger("specproxy")

__all__ = ["MIGRATIONS", "Writer", "check_schema", "connect", "migrate", "open_existing", "open_store"]


# Each migration is literal SQL, frozen once released: a database made by any earlier version passes
# through exactly the steps a new one does, so the two cannot diverge. A schema change is a new
# migration appended here (tests/unit/test_config_store.py holds every released one to its hash, and the
# database the migrations build to Record's fields). Named and ordered; each runs once, in its own
# transaction, and is recorded in _migrations.
MIGRATIONS: list[tuple[str, tuple[str, ...]]] = [
    ("001_turns", (
        """CREATE TABLE "turns" (
    "id" TEXT PRIMARY KEY, "t_wall" REAL, "method" TEXT, "path" TEXT, "status" INTEGER, "outcome" TEXT,
    "error" TEXT, "streamed" INTEGER, "model" TEXT, "label" TEXT, "instance_id" TEXT, "request_parsed" INTEGER,
    "concurrency" INTEGER, "t_request" REAL, "t_upstream_headers" REAL, "t_first_token" REAL,
    "t_last_token" REAL, "t_done" REAL, "ttft_s" REAL, "decode_s" REAL, "total_s" REAL,
    "completion_tokens" INTEGER, "content_tokens" INTEGER, "reasoning_tokens" INTEGER,
    "tool_args_tokens" INTEGER, "first_chunk_tokens" INTEGER, "usage_completion_tokens" INTEGER,
    "usage_prompt_tokens" INTEGER, "chunks" INTEGER, "tokens_per_chunk" REAL, "decode_tps" REAL,
    "prompt_tokens" INTEGER, "prompt_system_tokens" INTEGER, "prompt_tools_tokens" INTEGER,
    "prompt_history_tokens" INTEGER, "prompt_new_tokens" INTEGER, "proxy_delay_s" REAL,
    "request_bytes" INTEGER, "response_bytes" INTEGER, "saw_done" INTEGER, "finish_reason" TEXT,
    "server_timings" TEXT, "tokenizer" TEXT, "prompt_text" TEXT, "response_text" TEXT
)""",
        'CREATE INDEX "idx_turns_t_wall" ON "turns" ("t_wall")',
        'CREATE INDEX "idx_turns_label" ON "turns" ("label")',
    )),
    ("002_scrapes_and_instances", (
        """CREATE TABLE "scrapes" (
    "id" INTEGER PRIMARY KEY, "t_wall" REAL, "t_mono" REAL, "instance_id" TEXT, "server_kind" TEXT,
    "requests_running" REAL, "requests_waiting" REAL, "generation_tokens_total" REAL,
    "prompt_tokens_total" REAL, "spec_drafts_total" REAL, "spec_draft_tokens_total" REAL,
    "spec_accepted_tokens_total" REAL, "spec_accept_length" REAL, "spec_accept_rate" REAL, "raw" TEXT
)""",
        'CREATE INDEX "idx_scrapes_t_wall" ON "scrapes" ("t_wall")',
        'CREATE TABLE "instances" ("instance_id" TEXT PRIMARY KEY, "first_seen" REAL, "last_seen" REAL, "detail" TEXT)',
    )),
    ("003_turn_counters_and_scrape_errors", (
        'ALTER TABLE "scrapes" ADD COLUMN "error" TEXT',
        """CREATE TABLE "turn_counters" (
    "turn_id" TEXT PRIMARY KEY, "instance_id" TEXT, "seconds" REAL, "generated_tokens" REAL, "drafts" REAL,
    "draft_tokens" REAL, "accepted_tokens" REAL, "mal" REAL, "acceptance_rate" REAL
)""",
    )),
    ("004_content_class", (
        'ALTER TABLE "turns" ADD COLUMN "content_class" TEXT',
    )),
    ("005_api_client_session", (
        'ALTER TABLE "turns" ADD COLUMN "api" TEXT',
        'ALTER TABLE "turns" ADD COLUMN "client" TEXT',
        'ALTER TABLE "turns" ADD COLUMN "session" TEXT',
        'ALTER TABLE "turns" ADD COLUMN "usage_cached_tokens" INTEGER',
        'CREATE INDEX "idx_turns_session" ON "turns" ("session")',
    )),
    ("006_captures", (
        """CREATE TABLE "captures" (
    "turn_id" TEXT PRIMARY KEY, "t_wall" REAL, "method" TEXT, "path" TEXT, "content_encoding" TEXT, "body" BLOB
)""",
        'CREATE INDEX "idx_captures_t_wall" ON "captures" ("t_wall")',
    )),
    ("007_measure_capped", (
        'ALTER TABLE "turns" ADD COLUMN "measure_capped" INTEGER',
    )),
    ("008_unmeasured_prefix_tools", (
        'ALTER TABLE "turns" ADD COLUMN "measured" INTEGER DEFAULT 1',
        'ALTER TABLE "turns" ADD COLUMN "prefix_reused_tokens" INTEGER',
        'ALTER TABLE "turns" ADD COLUMN "prefix_break_part" TEXT',
        'ALTER TABLE "turns" ADD COLUMN "turn_diff" TEXT',
        'ALTER TABLE "turns" ADD COLUMN "tools_defined" INTEGER',
        'ALTER TABLE "turns" ADD COLUMN "tools_called" INTEGER',
        'ALTER TABLE "turns" ADD COLUMN "tool_names" TEXT',
    )),
    ("009_conn_id", (
        'ALTER TABLE "turns" ADD COLUMN "conn_id" INTEGER',
    )),
    ("010_measure_capped_reason", (
        'ALTER TABLE "turns" ADD COLUMN "measure_capped_reason" TEXT',
    )),
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
            if p.is_dir():
                raise StoreError(f"{p}: is a directory, not a database file")
            if p.parent and not p.parent.exists():
                raise StoreError(f"cannot create database {p}: directory {p.parent} does not exist")
            conn = sqlite3.connect(p, check_same_thread=False, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA busy_timeout=2000")
    except sqlite3.Error as exc:
        raise StoreError(f"{p}: cannot open database: {exc}{why_not_writable(p)}") from None
    if existing:
        try:
            check_schema(conn, p)
        except _OlderSchema:
            conn.close()
            _upgrade(p)
            return connect(path, readonly=readonly, existing=True)
        except BaseException:
            conn.close()
            raise
    return conn


class _OlderSchema(StoreError):
    """A specproxy database that lacks only later migrations: upgraded in place, never refused."""


def _upgrade(p: Path) -> None:
    """Apply the migrations an older specproxy's database lacks. They only add tables and columns, so a
    read command may run them: the turns an older version recorded stay readable after an upgrade."""
    try:
        conn = sqlite3.connect(f"file:{p}?mode=rw", uri=True, check_same_thread=False, isolation_level=None)
        try:
            conn.execute("PRAGMA busy_timeout=2000")
            applied = migrate(conn)
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise StoreError(f"{p}: written by an older specproxy, and cannot be upgraded in place: {exc}") from None
    log.info("%s: upgraded to the current schema (%s)", p, ", ".join(applied))


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
        raise StoreError(f"{p}: cannot read database: {exc}{why_not_writable(p)}") from None
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
        raise _OlderSchema(f"{p}: written by an older specproxy (schema step {missing[0]} not applied)")


def why_not_writable(p: Path) -> str:
    """Why SQLite cannot open a database here, when the directory says it: a WAL database, even read,
    needs its ``-shm`` (and ``-wal``) file beside it, created on first open. "" when nothing is wrong
    with the directory (SQLite's own message then stands alone)."""
    d = p.parent
    try:
        read_only = bool(os.statvfs(d).f_flag & os.ST_RDONLY)
    except OSError:
        return ""
    if read_only:
        where = f"{d} is on a read-only file system"
    elif not os.access(d, os.W_OK):
        where = f"{d} is not writable by this user"
    else:
        return ""
    return f" ({where}: SQLite must create {p.name}-shm beside a WAL database, even to read it)"


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return -1


_NOTADB = 26
_FULL = 13  # SQLITE_FULL: the disk (or max_page_count) has no room for the whole transaction
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
        why = why_not_writable(Path(path))
        raise StoreError(f"{path}: cannot {'read' if readonly else 'write'} database: {exc}{why}") from None
    finally:
        conn.close()


def migrate(conn: sqlite3.Connection) -> list[str]:
    """Apply the migrations not yet applied; return their names."""
    conn.execute("CREATE TABLE IF NOT EXISTS _migrations (name TEXT PRIMARY KEY, applied_at REAL)")
    done = {row[0] for row in conn.execute("SELECT name FROM _migrations")}
    applied = []
    for name, statements in MIGRATIONS:
        if name in done:
            continue
        conn.execute("BEGIN IMMEDIATE")
        try:
            for sql in statements:
                conn.execute(sql)
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
        raise StoreError(f"cannot write database {path}: {exc}{why_not_writable(Path(path))}") from None
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


_WAKE = object()  # put by close(): the writer thread wakes at once instead of at its next poll
COMMIT_GAP_S = 0.05  # at most one commit per this long: records that come meanwhile go in the next together,
GAP_BATCH = 32  # unless this many wait already: enough to make a commit cheap per row (and no cap on throughput)
RETRY_S = (0.2, 0.4, 0.8, 1.6)  # waits between attempts at a batch the database refuses, while none of it fits
STOP_RETRY_S = 5.0  # closing: how long a refused batch is retried before it is dropped (counted, logged)


class Writer:
    """The single writer thread. ``put`` never blocks; ``close`` drains what was queued."""

    def __init__(self, path: str | Path, *, queue_size: int = 10000, batch_size: int = 1000,
                 commit_gap_s: float = COMMIT_GAP_S, scrape_retention_days: float = 0.0) -> None:
        """``commit_gap_s``: after a commit, the next waits this long at least; a record that comes to an
        idle writer is written at once. Why not wait for more (it once lingered 250 ms, which halved its CPU
        per relayed chunk at 64 streams, docs/performance.md): a SIGKILL then lost the last quarter second.

        ``scrape_retention_days``: scrapes older than this are deleted at start-up and hourly, a chunk at a
        time between batches (retention.py); 0 keeps them all."""
        self.path = Path(path)
        self._commit_gap_s = commit_gap_s
        self._conn = open_store(self.path)  # fail at start-up, not at the first turn
        # SimpleQueue: a put is one C call (queue.Queue's is Python with a Condition, several times dearer
        # on the event loop); the bound is checked before each put (exact while one thread puts, as the loop does)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._queue_size = queue_size
        self._batch_size = batch_size
        self._stop = threading.Event()
        self.retention = ScrapeRetention(scrape_retention_days)
        self._thread = threading.Thread(target=self._run, name="specproxy-writer", daemon=True)
        self.written = 0
        self.commits = 0
        self.dropped = 0  # records never written: the queue was full, or still unwritten at shutdown
        self.retries = 0
        self.write_failures = 0  # attempts the database refused (each split of a batch counts)
        self.bad_rows = 0
        self.last_error: str | None = None
        self._held = 0  # records the writer has taken from the queue and not yet written
        self._full = False  # the latest refusal was for want of room (worth splitting the batch for)
        self._logged: set[str] = set()  # the causes of failure logged since the last write that succeeded
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
        """Records waiting to be written: queued, and those the writer holds (a batch it retries)."""
        return self._queue.qsize() + self._held

    def close(self, timeout: float = 30.0) -> None:
        """Stop after writing everything queued so far (bounded by ``timeout``)."""
        self._stop.set()
        self._queue.put(_WAKE)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._conn.close()

    def _run(self) -> None:
        name_os_thread()
        pending: list = []
        refused = 0  # rounds in a row in which nothing of the batch could be written
        while True:
            if not pending:
                self.retention.run_if_due(self._conn)  # here: never while a batch waits
                try:
                    item = self._queue.get(timeout=0.1)
                    if item is not _WAKE:
                        pending.append(item)
                    elif self._stop.is_set() and self._queue.empty():
                        return
                    continue
                except queue.Empty:
                    # only an empty queue ends the thread: CPython's timed SimpleQueue.get can raise Empty
                    # with records queued (its wait times out as a put lands), and returning then lost
                    # every record put just before close() (seen in the test suite, 2026-11-30)
                    if self._stop.is_set() and self._queue.empty():
                        return
                    continue
            while len(pending) < self._batch_size:  # what has queued meanwhile: never waits for more
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _WAKE:
                    pending.append(item)
            self._held = len(pending)
            before = len(pending)
            pending = self._write_what_fits(pending)
            self._held = len(pending)
            if not pending:
                refused = 0
                if self._logged:  # every record it held is written: a cause seen again is logged again
                    log.warning("database %s: writing again (%d attempts refused so far)", self.path,
                                self.write_failures)
                    self._logged.clear()
                if not self._stop.is_set() and self._queue.qsize() < GAP_BATCH:
                    self._stop.wait(self._commit_gap_s)  # what comes meanwhile goes in the next commit
            elif self._stop.is_set() and self._stop_deadline_passed():
                self._drop_at_stop(pending)
                return
            else:
                self.retries += 1
                refused = 0 if len(pending) < before else refused + 1
                self._stop.wait(RETRY_S[min(refused, len(RETRY_S) - 1)])  # locked, full disk: again later

    _stop_since: float | None = None

    def _stop_deadline_passed(self) -> bool:
        self._stop_since = self._stop_since or time.monotonic()
        return time.monotonic() - self._stop_since > STOP_RETRY_S

    def _drop_at_stop(self, pending: list) -> None:
        """Closing, and the database still refuses: count what is lost (held and still queued), say it once."""
        lost = len(pending)
        with suppress(queue.Empty):
            while True:
                lost += self._queue.get_nowait() is not _WAKE
        self._held = 0
        self.dropped += lost
        log.error("database %s: %d records could not be written before shutdown and are lost (%s)",
                  self.path, lost, self.last_error)

    def _write_what_fits(self, items: list) -> list:
        """Write ``items`` in order, as many as the database takes: the whole batch, else the longest
        prefix that commits, found by halving (a full disk may hold some of a batch, not all; a locked or
        read-only one none, so it is not split for them); what is left is returned, to be retried. A first
        record that does not fit even alone (one larger than the room left) is passed over once per call,
        so that it does not hold back smaller ones behind it; at most 2 (log2(len) + 1) refused attempts
        per call."""
        skipped: list = []
        while items:
            n = len(items)
            while n and not self._write(items[:n]):
                n = n // 2 if self._full else 0  # a full disk may take part of a batch; a lock refuses all
            if n == 0:  # not even the first fits
                if skipped or not self._full:
                    return skipped + items
                skipped, items = items[:1], items[1:]
            else:
                items = items[n:]
            self._held = len(skipped) + len(items)
        return skipped

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
            self.commits += 1  # the live page redraws when this moves (turns or scrapes landed)
            return True
        except sqlite3.OperationalError as exc:  # locked, busy, disk full, read-only: transient
            self.last_error = str(exc)
            self._full = getattr(exc, "sqlite_errorcode", _FULL) & 0xFF == _FULL
            self.write_failures += 1
            if self.last_error not in self._logged:  # once per cause, until a write succeeds again
                self._logged.add(self.last_error)
                log.error("database %s: writing %d records failed: %s; they wait and are retried (the queue "
                          "holds %d; past it records are dropped and counted)", self.path, len(items),
                          self.last_error, self._queue_size)
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
