"""A fleet's PostgreSQL database (what ``serve --sink`` fills) as a ``Source``: the same primitive reads
as ``sqlite_source.py``, value for value, so every analysis runs on it unchanged.

Why its own SQL and no shared query builder: the two engines differ in the few places that matter here
(SQLite's ``IS`` against PostgreSQL's ``IS NOT DISTINCT FROM``, ``rowid`` against the ``seq`` the fleet
schema numbers turns by, placeholders), and each read is one short statement; the analysis stays the one
copy (``store/source.py``). Windows and labels go into the WHERE clause, where the ``(t_wall)`` and
``(label, t_wall)`` indexes and the day partitions select the rows, never into Python after a full read.

How the turns come: the numeric columns of a row packed by PostgreSQL into one binary string (``float8send``,
NULL as NaN) and read by numpy at once, the text columns as values, in a binary cursor, ordered in numpy;
1.6x faster at 1M turns than a value per column and row sorted by PostgreSQL (scripts/bench_report_pg.py,
docs/performance.md). Coding the text columns as dictionary indexes in SQL was measured too: no faster.

What is read: columns of the fleet's ``turns`` (booleans are SMALLINT there, as SQLite stores them, so
they load as the same 0/1 floats), ``scrapes`` of every proxy, ``turn_counters`` in the order the database
took them (``seq``, migration ``002_counters_seq``). A URL with a password is refused by the sink's rule
(``config.check_sink_url``); the password comes from ``PGPASSWORD`` or ``.pgpass``. A database no proxy
has shipped to yet (no tables) reads as empty, as an SQLite file's missing table does.

With ``cache``, the turns come from the columnar cache in the user's cache directory (``pg_cache.py``:
checked day partition by day partition against the database on every load, a changed day read again),
filtered as the SQLite cache's are (``dataset.select_columns``): the same columns, values and order as
the SQL read here (tests/integration/test_pg_cache.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import psycopg

from specproxy.config import check_sink_url
from specproxy.errors import ConfigError
from specproxy.store import pg_cache
from specproxy.store.dataset import NUMERIC, TEXT, Turns, select_columns
from specproxy.store.sinks.postgres import CONNECT_TIMEOUT_S, one_line
from specproxy.store.source import SCRAPE_FIELDS, LoneJoins, Scrapes, Source, Window

__all__ = ["PgSource"]

# rows fetched per round trip of a server-side cursor (a million turns never sit in libpq's buffer at once)
FETCH_ROWS = 50_000


def _where(window: Window, *, measured_only: bool = True, prefix: str = "") -> tuple[str, list]:
    """``dataset.where_clause``'s filter in PostgreSQL: measured rows (``measured`` not 0; NULL counts
    as measured, as in SQLite), one label, ``[since, until)``."""
    where, params = ([f"{prefix}measured IS DISTINCT FROM 0"] if measured_only else []), []
    for clause, value in ((f"{prefix}label = %s", window.label), (f"{prefix}t_wall >= %s", window.since),
                          (f"{prefix}t_wall < %s", window.until)):
        if value is not None:
            where.append(clause)
            params.append(value)
    return (" WHERE " + " AND ".join(where) if where else ""), params


_OK_SCRAPE = "error IS NULL AND server_kind IS NOT NULL"


class PgSource(Source):
    """``url``: ``postgresql://USER@HOST[:PORT]/DB``; connects at once (one line if it cannot). ``cache``:
    read the turns through the columnar cache (``pg_cache.py``)."""

    def __init__(self, url: str, *, cache: bool = False) -> None:
        check_sink_url(url)
        self.url = url
        self.cache = cache
        self._unmeasured: dict[Window, int] = {}  # counted from the cached columns of a window loaded
        try:
            self.conn = psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT_S, autocommit=True,
                                        application_name="specproxy-read")
        except psycopg.Error as exc:
            raise ConfigError(f"cannot connect to {url}: {one_line(exc)}") from None
        try:
            self.tables = {name for (name,) in self.conn.execute(
                "SELECT c.relname FROM pg_class c WHERE c.relname IN ('turns', 'scrapes', 'turn_counters') AND "
                "pg_table_is_visible(c.oid)")}
            self._counter_seq = "turn_counters" in self.tables and self._has_column("turn_counters", "seq")
            # a database no sink of this version has migrated yet (007_scrape_latency): its scrapes read
            # as sent when their headers came, as Scrapes.sent reads a NULL latency
            latency = "scrapes" in self.tables and self._has_column("scrapes", "latency_s")
            self._scrape_fields = ", ".join(f if f != "latency_s" or latency else "NULL" for f in SCRAPE_FIELDS)
            self._sent = "t_wall - coalesce(latency_s, 0)" if latency else "t_wall"
        except psycopg.Error as exc:
            self.conn.close()
            raise ConfigError(f"cannot read {url}: {one_line(exc)}") from None

    def _has_column(self, table: str, column: str) -> bool:
        return bool(self.conn.execute(
            "SELECT 1 FROM information_schema.columns WHERE table_name = %s AND column_name = %s AND "
            "table_schema = current_schema()", (table, column)).fetchone())

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> PgSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _rows(self, sql: str, params: Sequence[Any] = (), *, binary: bool = False) -> list[tuple]:
        try:
            with self.conn.cursor(binary=binary) as cur:
                return cur.execute(sql, params).fetchall()
        except psycopg.Error as exc:
            raise ConfigError(f"cannot read {self.url}: {one_line(exc)}") from None

    def _one(self, sql: str, params: Sequence[Any] = ()) -> Any:
        rows = self._rows(sql, params)
        return rows[0][0] if rows else None

    def turns(self, window: Window, columns: Sequence[str] | None = None) -> Turns:
        cols = tuple(columns) if columns is not None else NUMERIC + TEXT
        unknown = [c for c in cols if c not in NUMERIC and c not in TEXT]
        if unknown:
            raise ValueError(f"unknown turn columns: {unknown}")
        want_num = tuple(c for c in NUMERIC if c in cols or c == "t_wall")
        want_txt = tuple(c for c in TEXT if c in cols)
        if self.cache and "turns" in self.tables:
            filters = ("label",) * (window.label is not None)
            found = pg_cache.load_columns(self.conn, tuple(dict.fromkeys((*want_num, "measured"))),
                                          tuple(dict.fromkeys(want_txt + filters)), window.since, window.until)
            if found is not None:
                counts: dict[str, int] = {}
                turns = select_columns(found, want_num, want_txt, **window.as_dict(), path=None, counts=counts)
                self._unmeasured[window] = counts["unmeasured"]
                return turns
        if "turns" not in self.tables:
            rows: list[tuple] = []
        else:
            where, params = _where(window)
            packed = " || ".join(["int8send(seq)", *(f"float8send(coalesce({c}::float8, 'NaN'))" for c in want_num)])
            rows = self._rows(f"SELECT {packed}{''.join(', ' + c for c in want_txt)} FROM turns{where}", params,
                              binary=True)
        columns_ = list(zip(*rows)) if rows else [() for _ in range(1 + len(want_txt))]
        packed_rows = np.frombuffer(b"".join(columns_[0]), dtype=[("seq", ">i8"), *((c, ">f8") for c in want_num)])
        # ORDER BY t_wall, seq in numpy: sorting every selected row in PostgreSQL (wide rows, past work_mem:
        # on disk) took longer than fetching them; t_wall is never NULL there
        order = np.lexsort((packed_rows["seq"], packed_rows["t_wall"]))
        num = {"rowid": packed_rows["seq"][order].astype(np.int64)}
        num.update({name: packed_rows[name][order].astype(np.float64) for name in want_num})
        txt = {name: np.array(columns_[1 + i], dtype=object)[order] for i, name in enumerate(want_txt)}
        return Turns(num, txt)

    def scrapes(self, t0: float, t1: float) -> Scrapes:
        if "scrapes" not in self.tables:
            return Scrapes.empty()
        return Scrapes.from_rows(self._rows(
            f"SELECT t_wall, instance_id, server_kind, error, {self._scrape_fields} FROM scrapes "
            "WHERE t_wall >= %s AND t_wall <= %s ORDER BY t_wall, store_id, id", (t0, t1)))

    def scrape_time(self, t: float, *, after: bool, ok: bool = True, not_after: float | None = None) -> float | None:
        if "scrapes" not in self.tables:
            return None
        where = f" AND {_OK_SCRAPE}" if ok else ""
        if after:  # sent at or after t (Source's contract), walked in t_wall order from t
            bound = float("inf") if not_after is None else not_after
            return self._one(f"SELECT t_wall FROM scrapes WHERE t_wall >= %s AND t_wall <= %s AND {self._sent} >= %s"
                             f"{where} ORDER BY t_wall LIMIT 1", (t, bound, t))
        return self._one(f"SELECT max(t_wall) FROM scrapes WHERE t_wall <= %s{where}", (t,))

    def lone_joins(self, window: Window) -> LoneJoins:
        if not {"turns", "turn_counters"} <= self.tables:
            return LoneJoins()
        where, params = _where(window, prefix="t.")
        order = "c.seq" if self._counter_seq else "c.turn_id"
        return LoneJoins.from_rows(self._rows(f"SELECT t.seq, c.mal FROM turn_counters c JOIN turns t ON "
                                              f"t.id = c.turn_id{where} ORDER BY {order}", params))

    def unmeasured(self, window: Window) -> int:
        """From the cached columns when the window's turns came from them, else one count in SQL."""
        if window in self._unmeasured:
            return self._unmeasured[window]
        if "turns" not in self.tables:
            return 0
        where, params = _where(window, measured_only=False)
        clause = f"{where} AND measured = 0" if where else " WHERE measured = 0"
        return int(self._one(f"SELECT count(*) FROM turns{clause}", params))

    def database(self) -> dict[str, Any]:
        if "turns" not in self.tables:
            return {"n": 0, "first_t_wall": None, "last_t_wall": None, "other": 0, "labels": []}
        n, first, last = self._rows("SELECT count(*), min(t_wall), max(t_wall) FROM turns "
                                    "WHERE measured IS DISTINCT FROM 0")[0]
        other = self._one("SELECT count(*) FROM turns WHERE measured = 0")
        return {"n": int(n), "first_t_wall": first, "last_t_wall": last, "other": int(other), "labels": self.labels()}

    def labels(self) -> list[str]:
        if "turns" not in self.tables:
            return []
        rows = self._rows("SELECT DISTINCT label FROM turns WHERE measured = 1 AND label IS NOT NULL")
        return sorted(str(r[0]) for r in rows)

    def recent(self, window: Window, fields: Sequence[str], limit: int) -> list[tuple]:
        if "turns" not in self.tables:
            return []
        where, params = _where(window)
        rows = self._rows(f"SELECT {', '.join(fields)} FROM turns{where} ORDER BY t_wall DESC, seq DESC LIMIT %s",
                          (*params, limit))
        return rows[::-1]

    def nth_newest_t_wall(self, window: Window, n: int) -> float | None:
        if "turns" not in self.tables:
            return None
        where, params = _where(window)
        value = self._one(f"SELECT t_wall FROM turns{where} ORDER BY t_wall DESC, seq DESC LIMIT 1 OFFSET %s",
                          (*params, n - 1))
        return None if value is None else float(value)

    @contextmanager
    def consistent(self) -> Iterator[None]:
        """One REPEATABLE READ transaction: its reads share one snapshot (the cache's own transaction
        inside it asks the same level, which PostgreSQL allows)."""
        if self.conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            yield
            return
        with self.conn.transaction():
            try:
                self.conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            except psycopg.Error as exc:
                raise ConfigError(f"cannot read {self.url}: {one_line(exc)}") from None
            yield

    def rows(self, fields: Sequence[str], window: Window) -> Iterator[tuple]:
        """Every row the window selects (of any path: ``export``), oldest first, as tuples of ``fields``;
        through a server-side cursor, so an export of the whole fleet streams."""
        if "turns" not in self.tables:
            return
        where, params = _where(window, measured_only=False)
        try:
            with self.conn.transaction(), self.conn.cursor(name="specproxy_export") as cur:
                cur.itersize = FETCH_ROWS
                cur.execute(f"SELECT {', '.join(fields)} FROM turns{where} ORDER BY t_wall, seq", params)
                yield from cur
        except psycopg.Error as exc:
            raise ConfigError(f"cannot read {self.url}: {one_line(exc)}") from None
