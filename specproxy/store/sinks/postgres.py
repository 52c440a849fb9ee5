"""The PostgreSQL sink: a batch of local rows into the fleet's database by COPY, idempotently.

Why COPY straight into the table first: COPY is the fast way in, and a batch is nearly always new and
valid (the staging table and the conflict check cost as much again: scripts/bench_ship.py). COPY cannot
skip a row already held, though: when the straight COPY fails on its rows (a batch sent again because the
proxy was killed before it noted it as sent, or the sink timed out after committing; or a row PostgreSQL
refuses), nothing of it was taken (a savepoint), and the careful way runs: COPY into a temporary staging
table, then one INSERT ... ON CONFLICT DO NOTHING, so a batch sent again adds nothing. Why bisect on a
refused row: one row PostgreSQL will not hold (a value out of its column's range, a NUL in a text) must
not cost the others, so a batch that fails on its data is split in halves, each in its own savepoint, down to the rows that
fail alone (log2 of the batch's attempts per bad row); those are returned with the reason.

Connection failures, credentials, permissions and a ``proxy_name`` another database already ships under
are ``SinkError``: one line, and the shipper retries later while the local database keeps every row. The
URL never holds a password (``config.check_sink_url``); libpq reads it from ``PGPASSWORD`` or ``.pgpass``.
"""

from __future__ import annotations

import datetime
import math
import time
from operator import itemgetter

import psycopg
from psycopg import sql

from specproxy.store.sinks import Identity, Refused, SinkError
from specproxy.store.sinks.pg_migrations import PG_MIGRATIONS

__all__ = ["LOCK_ID", "PostgresSink", "connect", "migrate"]

LOCK_ID = 35_000_001  # the advisory lock under which proxies migrate and make partitions, one at a time
CONNECT_TIMEOUT_S = 5
STATEMENT_TIMEOUT_MS = 60_000  # a sink that hangs mid-batch is given up on and the batch retried
DAY_S = 86400
_LAST_DAY = 84_000  # partitions are made for days before this (year 2199); a turn dated later is refused
# errors of the rows, not of the sink: the batch is split to find them
_ROW_ERRORS = (psycopg.DataError, psycopg.IntegrityError, UnicodeError, ValueError, OverflowError)


def connect(url: str) -> psycopg.Connection:
    """A connection for a sink, or SinkError with libpq's reason in one line."""
    try:
        return psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT_S, autocommit=True, application_name="specproxy",
                               options=f"-c statement_timeout={STATEMENT_TIMEOUT_MS}", keepalives=1,
                               keepalives_idle=10, keepalives_interval=5, keepalives_count=3)
    except psycopg.Error as exc:
        raise SinkError(f"cannot connect: {one_line(exc)}") from None


def one_line(exc: BaseException) -> str:
    """An error of libpq or the server as one line, without the row's values (a DETAIL may quote them)."""
    diag = getattr(exc, "diag", None)
    primary = diag.message_primary if diag is not None else None
    text = primary or str(exc)
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def migrate(conn: psycopg.Connection) -> list[str]:
    """Apply the PostgreSQL migrations not yet applied (under an advisory lock: proxies starting together
    take turns); their names. SinkError for a database a newer specproxy migrated, or without rights."""
    applied = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_ID,))
        conn.execute("CREATE TABLE IF NOT EXISTS specproxy_migrations (name TEXT PRIMARY KEY, "
                     "applied_at DOUBLE PRECISION)")
        done = {row[0] for row in conn.execute("SELECT name FROM specproxy_migrations")}
        known = [name for name, _ in PG_MIGRATIONS]
        newer = sorted(done - set(known))
        if newer:
            raise SinkError(f"written by a newer specproxy (schema step {newer[0]} is unknown here): upgrade "
                            "this proxy to ship to it")
        for name, statements in PG_MIGRATIONS:
            if name in done:
                continue
            for statement in statements:
                conn.execute(statement)
            conn.execute("INSERT INTO specproxy_migrations VALUES (%s, %s)", (name, time.time()))
            applied.append(name)
    return applied


def _days(rows: list[tuple], field: int) -> set[int]:
    """The UTC days of the rows' ``field`` (a turn's t_wall). A value no partition can hold is left out
    (PostgreSQL refuses that row on its own). Usually a batch spans at most a day: then its days are those
    of its first and last t_wall (two C-level passes instead of a Python step per row)."""
    t_walls = list(map(itemgetter(field), rows))
    try:
        lo, hi = min(t_walls), max(t_walls)
    except (TypeError, ValueError):  # a NULL or a text among them; no rows
        lo = hi = math.nan
    if 0 <= lo and hi < _LAST_DAY * DAY_S and hi - lo <= DAY_S:  # (False for a NaN)
        return {int(lo // DAY_S), int(hi // DAY_S)}
    return {int(t // DAY_S) for t in t_walls
            if isinstance(t, (int, float)) and math.isfinite(t) and 0 <= t < _LAST_DAY * DAY_S}


class _Table:
    """How one local table goes in: the columns the sink adds in front of the local ones (who shipped it)."""

    def __init__(self, name: str, identity_columns: tuple[str, ...]) -> None:
        self.name = name
        self.identity_columns = identity_columns


_TABLES = {"turns": _Table("turns", ()), "scrapes": _Table("scrapes", ("store_id", "proxy_name")),
           "turn_counters": _Table("turn_counters", ())}


class PostgresSink:
    """A fleet's PostgreSQL database (``postgresql://USER@HOST[:PORT]/DB``). Used by one shipper thread."""

    def __init__(self, url: str) -> None:
        self.name = url
        self._conn: psycopg.Connection | None = None
        self._identity: Identity | None = None
        self._days: set[int] = set()  # partitions known to exist
        self._staged: set[str] = set()  # staging tables made on this connection

    def open(self, identity: Identity) -> None:
        self.close()
        conn = connect(self.name)
        try:
            migrate(conn)
            self._claim(conn, identity)
        except psycopg.errors.InsufficientPrivilege as exc:
            conn.close()
            raise SinkError(f"permission denied ({one_line(exc)}): the user needs the right to create tables in "
                            "the database's schema (GRANT CREATE ON SCHEMA public TO ...), or its owner to run "
                            "specproxy once first") from None
        except psycopg.Error as exc:
            conn.close()
            raise SinkError(one_line(exc)) from None
        except BaseException:
            conn.close()
            raise
        self._conn, self._identity, self._days, self._staged = conn, identity, set(), set()

    def _claim(self, conn: psycopg.Connection, identity: Identity) -> None:
        """Ship under ``identity.proxy_name`` only if no other local database does: refused, never merged."""
        now = time.time()
        with conn.transaction():
            conn.execute("INSERT INTO proxies VALUES (%s, %s, %s, %s) ON CONFLICT (proxy_name) DO NOTHING",
                         (identity.proxy_name, identity.store_id, now, now))
            (owner,) = conn.execute("SELECT store_id FROM proxies WHERE proxy_name = %s FOR UPDATE",
                                    (identity.proxy_name,)).fetchone()
            if owner != identity.store_id:
                raise SinkError(f"proxy_name {identity.proxy_name!r} already ships here from another proxy's "
                                "database: give each proxy its own proxy_name (its turns are kept locally until "
                                "then)")
            conn.execute("UPDATE proxies SET last_seen = %s WHERE proxy_name = %s", (now, identity.proxy_name))

    def send(self, table: str, columns: tuple[str, ...], rows: list[tuple]) -> list[Refused]:
        conn, identity = self._conn, self._identity
        if conn is None or identity is None:
            raise SinkError("not connected")
        spec = _TABLES[table]
        names = spec.identity_columns + columns
        if spec.identity_columns:  # who shipped it, in front of every row
            extra = tuple(getattr(identity, c) for c in spec.identity_columns)
            rows = [extra + row for row in rows]
        refused: list[Refused] = []
        try:
            if table == "turns":
                self._make_partitions(conn, _days(rows, names.index("t_wall")))
            with conn.transaction():  # one transaction per batch
                if not self._copy_straight(conn, table, names, rows):
                    self._insert(conn, self._statements(conn, table, names), list(enumerate(rows)), refused)
        except psycopg.Error as exc:
            self.close()
            raise SinkError(one_line(exc)) from None
        return refused

    @staticmethod
    def _copy_straight(conn: psycopg.Connection, table: str, names: tuple[str, ...], rows: list[tuple]) -> bool:
        """The usual batch: none of its rows is held yet and each is valid, so one COPY straight into the
        table holds it (no staging table, no conflict check: about twice as fast). False, having taken
        nothing, when a row is already held (a batch sent again) or refused: the careful way does it."""
        copy = sql.SQL("COPY {} ({}) FROM STDIN").format(sql.Identifier(table),
                                                          sql.SQL(", ").join(map(sql.Identifier, names)))
        try:
            with conn.transaction(), conn.cursor() as cur, cur.copy(copy) as out:
                for row in rows:
                    out.write_row(row)
        except _ROW_ERRORS:
            return False
        return True

    def _statements(self, conn: psycopg.Connection, table: str, names: tuple[str, ...]) -> tuple:
        """The careful way's COPY into a staging table, INSERT ... ON CONFLICT DO NOTHING, TRUNCATE; the
        staging table made once per connection (the columns sent, of the table's types, no constraints:
        the INSERT checks them)."""
        stage = sql.Identifier(f"stage_{table}")
        columns = sql.SQL(", ").join(map(sql.Identifier, names))
        if table not in self._staged:
            conn.execute(sql.SQL("CREATE TEMP TABLE IF NOT EXISTS {} ON COMMIT DELETE ROWS AS SELECT {} FROM {} "
                                 "WITH NO DATA").format(stage, columns, sql.Identifier(table)))
            self._staged.add(table)
        return (sql.SQL("COPY {} ({}) FROM STDIN").format(stage, columns),
                sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {} ON CONFLICT DO NOTHING").format(
                    sql.Identifier(table), columns, columns, stage),
                sql.SQL("TRUNCATE {}").format(stage))

    def _insert(self, conn, statements: tuple, items: list[tuple[int, tuple]], refused: list[Refused]) -> None:
        """COPY ``items`` into the staging table and on into the table, in a savepoint; on a row's error,
        the halves apart, down to the rows that fail alone."""
        copy, insert, truncate = statements
        try:
            with conn.transaction(), conn.cursor() as cur:
                with cur.copy(copy) as out:
                    for _, row in items:
                        out.write_row(row)
                cur.execute(insert)
                cur.execute(truncate)
        except _ROW_ERRORS as exc:
            if len(items) == 1:
                refused.append(Refused(items[0][0], f"{type(exc).__name__}: {one_line(exc)}"))
                return
            half = len(items) // 2
            self._insert(conn, statements, items[:half], refused)
            self._insert(conn, statements, items[half:], refused)

    def _make_partitions(self, conn: psycopg.Connection, days: set[int]) -> None:
        """The day partitions these turns go in, made when missing (a turn dated where none can be made
        is refused by PostgreSQL: no partition holds it)."""
        for day in sorted(days - self._days):
            name = "turns_" + datetime.datetime.fromtimestamp(day * DAY_S, datetime.UTC).strftime("%Y%m%d")
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_ID,))
                conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} PARTITION OF turns FOR VALUES FROM ({}) TO ({})")
                             .format(sql.Identifier(name), sql.Literal(day * DAY_S), sql.Literal((day + 1) * DAY_S)))
            self._days.add(day)

    def close(self) -> None:
        self._staged = set()
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except psycopg.Error:
                pass
