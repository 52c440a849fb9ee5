"""SQLite storage: named migrations, opening a database with clear reasons when it cannot be, and the
schema check. The one writer thread is ``store/writer.py``'s.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from specproxy.errors import StoreError

log = logging.getLogger("specproxy")

__all__ = ["MIGRATIONS", "SQLITE_FULL", "check_schema", "connect", "file_size", "migrate", "open_existing",
           "open_store"]


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
    ("011_fleet", (
        'ALTER TABLE "turns" ADD COLUMN "proxy_name" TEXT',
        'CREATE TABLE "store_meta" ("key" TEXT PRIMARY KEY, "value" TEXT)',
        """INSERT INTO "store_meta" VALUES ('store_id', lower(hex(randomblob(16))))""",
        """CREATE TABLE "sink_progress" (
    "sink" TEXT, "tbl" TEXT, "last_rowid" INTEGER, "updated" REAL, PRIMARY KEY ("sink", "tbl")
)""",
        """CREATE TABLE "sink_refused" (
    "sink" TEXT, "tbl" TEXT, "row_key" TEXT, "reason" TEXT, "t_set_aside" REAL, PRIMARY KEY ("sink", "tbl", "row_key")
)""",
    )),
    ("012_tenant", (
        'ALTER TABLE "turns" ADD COLUMN "tenant" TEXT',
        'CREATE INDEX "idx_turns_tenant" ON "turns" ("tenant")',
        # the secret tenant_from_key's fingerprints are keyed with: drawn once per database, kept in it only
        """INSERT INTO "store_meta" VALUES ('tenant_key_secret', lower(hex(randomblob(32))))""",
    )),
    ("013_prefix_cache", (
        'ALTER TABLE "turns" ADD COLUMN "usage_cache_write_tokens" INTEGER',
        'ALTER TABLE "scrapes" ADD COLUMN "prefix_cache_queries_total" REAL',
        'ALTER TABLE "scrapes" ADD COLUMN "prefix_cache_hits_total" REAL',
    )),
    ("014_prompt_block_digests", (
        'ALTER TABLE "turns" ADD COLUMN "prompt_block_digests" TEXT',
    )),
    # A counter of the edits to rows already stored, kept by the database itself, so that the column cache
    # (store/column_cache.py) knows its rows are still the database's without scanning the table. An
    # insert of a new row is not an edit (the cache reads the rows above its highest rowid). INSERT OR
    # REPLACE (the writer's INSERT_TURN) removes the row it replaces through the DELETE trigger because
    # connect() turns recursive_triggers on: a BEFORE INSERT trigger looking the id up would cost the
    # writer an index probe per turn (~20 us) to catch what is, in specproxy, a rare retry.
    ("015_table_edits", (
        'CREATE TABLE "table_edits" ("name" TEXT PRIMARY KEY, "edits" INTEGER NOT NULL)',
        """INSERT INTO "table_edits" VALUES ('turns', 0), ('scrapes', 0)""",
        """CREATE TRIGGER "turns_edit_update" AFTER UPDATE ON "turns"
BEGIN UPDATE "table_edits" SET "edits" = "edits" + 1 WHERE "name" = 'turns'; END""",
        """CREATE TRIGGER "turns_edit_delete" AFTER DELETE ON "turns"
BEGIN UPDATE "table_edits" SET "edits" = "edits" + 1 WHERE "name" = 'turns'; END""",
        """CREATE TRIGGER "scrapes_edit_update" AFTER UPDATE ON "scrapes"
BEGIN UPDATE "table_edits" SET "edits" = "edits" + 1 WHERE "name" = 'scrapes'; END""",
        """CREATE TRIGGER "scrapes_edit_delete" AFTER DELETE ON "scrapes"
BEGIN UPDATE "table_edits" SET "edits" = "edits" + 1 WHERE "name" = 'scrapes'; END""",
    )),
    # The rows of other paths (measured = 0: forwarded, recorded, no figures) are few; counting them over a
    # month of turns scanned the table on every picture of an idle live page. A partial index holds them
    # alone, so their count (and the turns' count, the table's minus theirs) is a count of an index.
    ("016_unmeasured_index", (
        'CREATE INDEX "idx_turns_unmeasured" ON "turns" ("t_wall") WHERE "measured" = 0',
    )),
    # A scrape's page was built between its request's sending and its headers' arrival (``t_wall``): the
    # headers' time says the page is from no later, the sending time that it is from no earlier, which is
    # what a span's last scrape must be (docs/report.md, "The span").
    ("017_scrape_latency", (
        'ALTER TABLE "scrapes" ADD COLUMN "latency_s" REAL',
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
        # INSERT OR REPLACE's implicit delete fires the DELETE triggers that count edits (015_table_edits)
        conn.execute("PRAGMA recursive_triggers=ON")
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
        what = "an empty file (0 bytes)" if file_size(p) == 0 else (
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


def file_size(p: Path) -> int:
    """The file's size in bytes, -1 when it cannot be read."""
    try:
        return p.stat().st_size
    except OSError:
        return -1


_NOTADB = 26
SQLITE_FULL = 13  # SQLITE_FULL: the disk (or max_page_count) has no room for the whole transaction
# SQLite's primary result codes that say the file (not the query) is the problem
# (PERM, BUSY, LOCKED, READONLY, IOERR, CORRUPT, FULL, CANTOPEN, NOTADB)
_FILE_ERRORS = frozenset({3, 5, 6, 8, 10, 11, SQLITE_FULL, 14, _NOTADB})


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
