"""The SQLite file as a ``Source``: the primitive reads of ``source.py`` over ``queries.py``'s SQL.

Why a class over a connection: the CLI opens the file once (``db.open_existing``: every way it can be
the wrong file is one line) and every read of a report goes through the same connection and the same
filters (``dataset.where_clause``), with the columnar cache (``column_cache``) for the turns and the
scrapes when ``cache`` is set.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from specproxy.store import column_cache, queries
from specproxy.store.dataset import Turns, load_turns, where_clause
from specproxy.store.db import connect
from specproxy.store.source import SCRAPE_FIELDS, LoneJoins, Scrapes, Source, Window

__all__ = ["NARROW", "SQLiteSource"]

# a time window holding under 1/NARROW of the rows is read through the t_wall index, from SQLite: the
# columnar cache holds every turn, and loading it for the last hour of a month would read the month
NARROW = 8

# the scrapes as the columnar cache holds them: what ``Scrapes`` is made of
SCRAPE_TABLE = column_cache.Table("scrapes", ("t_wall", *SCRAPE_FIELDS), ("instance_id", "server_kind", "error"))


class SQLiteSource(Source):
    """``db``: an open connection (kept open: the caller's) or a path (opened read-only here; ``close()``)."""

    def __init__(self, db: str | Path | sqlite3.Connection, *, cache: bool = False) -> None:
        self._own = not isinstance(db, sqlite3.Connection)
        self.conn = connect(db, readonly=True) if self._own else db
        self.cache = cache
        self._unmeasured: dict[Window, int] = {}  # counted from the cached columns of a window loaded

    def close(self) -> None:
        if self._own:
            self.conn.close()

    def __enter__(self) -> SQLiteSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def turns(self, window: Window, columns: Sequence[str] | None = None) -> Turns:
        """Through the columnar cache (when ``cache``) unless the window is narrow: both give the same
        columns (``tests/unit/test_column_cache.py``), the cheaper one is read."""
        cache = self.cache and not self._narrow(window)
        counts: dict[str, int] = {}
        turns = load_turns(self.conn, **window.as_dict(), columns=columns, cache=cache, counts=counts)
        if "unmeasured" in counts:
            self._unmeasured[window] = counts["unmeasured"]
        return turns

    def _narrow(self, window: Window) -> bool:
        if window.since is None and window.until is None:
            return False
        limit = queries.max_rowid(self.conn) // NARROW
        return queries.rows_in_time(self.conn, window.since, window.until, limit) < limit

    def scrapes(self, t0: float, t1: float) -> Scrapes:
        """From the columnar cache (when ``cache``) unless it cannot serve them: the same rows in the same
        order as the SQL (``tests/unit/test_source.py``); the cache maps the table's columns, SQL turns
        each row into Python objects (1 s for the 121k scrapes beside a million turns)."""
        if self.cache:
            def between(num: dict[str, np.ndarray]) -> np.ndarray:
                t = num["t_wall"]
                idx = np.flatnonzero((t >= t0) & (t <= t1))  # NaN (NULL) compares false, as in SQL
                return idx[np.argsort(t[idx], kind="stable")]  # ties in rowid order, as the t_wall index has them

            got = column_cache.load_rows(self.conn, SCRAPE_TABLE, between)
            if got is not None:
                num, txt = got
                return Scrapes(num["t_wall"], txt["instance_id"], txt["server_kind"], txt["error"],
                               {f: num[f] for f in SCRAPE_FIELDS})
        return Scrapes.from_rows(queries.scrape_rows(self.conn, t0, t1, SCRAPE_FIELDS))

    def scrape_time(self, t: float, *, after: bool, ok: bool = True, not_after: float | None = None) -> float | None:
        if after:
            return queries.scrape_at_or_after(self.conn, t, not_after, ok=ok)
        return queries.scrape_at_or_before(self.conn, t, ok=ok)

    def lone_joins(self, window: Window) -> LoneJoins:
        return LoneJoins.from_rows(queries.lone_turn_mal(self.conn, *where_clause(**window.as_dict())))

    def unmeasured(self, window: Window) -> int:
        """From the cached columns when the window's turns came from them, else one count in SQL."""
        if window in self._unmeasured:
            return self._unmeasured[window]
        return queries.unmeasured_rows(self.conn, *where_clause(**window.as_dict(), measured_only=False))

    def database(self) -> dict[str, Any]:
        return queries.database_turns(self.conn)

    def labels(self) -> list[str]:
        return queries.turn_labels(self.conn)

    def recent(self, window: Window, fields: Sequence[str], limit: int) -> list[tuple]:
        return queries.recent_turns(self.conn, fields, *where_clause(**window.as_dict()), limit)

    def nth_newest_t_wall(self, window: Window, n: int) -> float | None:
        return queries.nth_newest_t_wall(self.conn, *where_clause(**window.as_dict()), n)

    @contextmanager
    def consistent(self) -> Iterator[None]:
        """One read transaction: in WAL mode its reads share the snapshot its first read takes (a
        transaction the caller holds already is that snapshot)."""
        if self.conn.in_transaction:
            yield
            return
        self.conn.execute("BEGIN")
        try:
            yield
        finally:
            if self.conn.in_transaction:
                self.conn.execute("COMMIT")
