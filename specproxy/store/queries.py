"""The read-side queries that analysis and the CLI ask of a database: every SQL string lives in the store.

Why here: the analysis works on columns and samples, not on SQL, so that a schema change is made in one
package and a reader finds every query of the database beside its schema. A table that an older
database lacks reads as empty (the caller says what is missing), never as an error.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Iterator, Sequence
from typing import Any

Connection = sqlite3.Connection


def database_turns(conn: Connection) -> dict[str, Any]:
    """How many turns (measured rows, what a report counts as turns) the whole database holds, the wall
    time of the first and last, how many rows of other paths (``other``) beside them, and the labels the
    turns carry (``labels``: so that a window naming a label no turn has can say which there are).

    Read when a window selects nothing (the live page of an idle proxy, every picture): the first and
    last through the t_wall index, the labels by seeking the label index, the other rows by counting the
    partial index that holds them alone (migration 016), the turns as the table's count less those.
    On a database without that index (opened read-only before its upgrade) the same counts scan."""
    (total,) = conn.execute("SELECT count(*) FROM turns").fetchone()
    (other,) = conn.execute("SELECT count(*) FROM turns WHERE measured = 0").fetchone()
    n = total - other
    ends = []
    for order in ("", " DESC"):
        row = conn.execute("SELECT t_wall FROM turns WHERE measured IS NOT 0 AND t_wall IS NOT NULL "
                           f"ORDER BY t_wall{order} LIMIT 1").fetchone()
        ends.append(None if row is None else row[0])
    return {"n": int(n), "first_t_wall": ends[0], "last_t_wall": ends[1], "other": int(other),
            "labels": turn_labels(conn)}


def unmeasured_rows(conn: Connection, where: str, params: Sequence[Any]) -> int:
    """Rows of other paths (``measured`` false) that a ``dataset.where_clause(measured_only=False)``
    selects: exchanges forwarded and recorded without figures."""
    clause = f"{where} AND measured = 0" if where else " WHERE measured = 0"
    return int(conn.execute(f"SELECT count(*) FROM turns{clause}", params).fetchone()[0])


def turn_labels(conn: Connection) -> list[str]:
    """The labels the measured turns carry (``measured`` not false, as every reader of turns selects
    them: ``dataset.where_clause``), sorted (the arms ``compare`` can name). Each distinct label is found
    by one seek of the label index and asked for one measured turn: a few labels over millions of turns
    cost a few lookups, not a scan of the table."""
    labels = []
    row = conn.execute("SELECT label FROM turns WHERE label IS NOT NULL ORDER BY label LIMIT 1").fetchone()
    try:
        conn.execute("SELECT measured FROM turns LIMIT 0")
        measured = " AND measured IS NOT 0"
    except sqlite3.OperationalError:  # a database from before ``measured``
        measured = ""
    while row is not None:
        if conn.execute(f"SELECT 1 FROM turns WHERE label = ?{measured} LIMIT 1", row).fetchone():
            labels.append(str(row[0]))
        row = conn.execute("SELECT label FROM turns WHERE label > ? ORDER BY label LIMIT 1", row).fetchone()
    return sorted(labels)


def scrape_rows(conn: Connection, t0: float, t1: float, fields: Sequence[str]) -> list[tuple]:
    """Stored scrapes with wall time in [t0, t1], oldest first: ``(t_wall, instance_id, server_kind,
    error, *fields)`` each."""
    try:
        return conn.execute(
            f"SELECT t_wall, instance_id, server_kind, error, {', '.join(fields)} FROM scrapes "
            "WHERE t_wall >= ? AND t_wall <= ? ORDER BY t_wall", (t0, t1)).fetchall()
    except sqlite3.OperationalError:
        return []


_OK_SCRAPE = "error IS NULL AND server_kind IS NOT NULL"


def scrape_at_or_before(conn: Connection, t: float, *, ok: bool = True) -> float | None:
    """The wall time of the last stored scrape at or before ``t`` (a successful one unless ``ok`` is
    false: then any attempt, failed ones included), or None."""
    where = f" AND {_OK_SCRAPE}" if ok else ""
    try:
        row = conn.execute(f"SELECT max(t_wall) FROM scrapes WHERE t_wall <= ?{where}", (t,)).fetchone()
    except sqlite3.OperationalError:
        return None
    return row[0]


def scrape_at_or_after(conn: Connection, t: float, not_after: float | None = None, *, ok: bool = True) -> float | None:
    """The wall time of the first stored scrape sent at or after ``t`` (``Scrapes.sent``) and not after
    ``not_after`` (a successful one unless ``ok`` is false), or None. Walked in ``t_wall`` order from
    ``t`` (a scrape's ``t_wall`` is never before its sending), so the index bounds the search."""
    where = f" AND {_OK_SCRAPE}" if ok else ""
    bound = math.inf if not_after is None else not_after
    try:
        row = conn.execute(f"SELECT t_wall FROM scrapes WHERE t_wall >= ? AND t_wall <= ? "
                           f"AND t_wall - coalesce(latency_s, 0) >= ?{where} ORDER BY t_wall LIMIT 1",
                           (t, bound, t)).fetchone()
    except sqlite3.OperationalError:
        return None
    return row[0] if row is not None else None


def lone_turn_mal(conn: Connection, where: str = "", params: Sequence[Any] = ()) -> list[tuple[int, float | None]]:
    """The stored lone-turn counter deltas of the turns a ``dataset.where_clause`` selects (every turn's
    without one) as ``(turn rowid, MAL)``, in the order the deltas were stored."""
    try:
        return conn.execute("SELECT t.rid, c.mal FROM turn_counters c JOIN "
                            f"(SELECT rowid AS rid, id FROM turns{where}) t ON t.id = c.turn_id "
                            "ORDER BY c.rowid", params).fetchall()
    except sqlite3.OperationalError:
        return []


def rows_in_time(conn: Connection, since: float | None, until: float | None, limit: int) -> int:
    """How many rows (of any path) have ``t_wall`` in ``[since, until)``, counted up to ``limit`` only
    (through the t_wall index: the cost is bounded by ``limit``, not by the table)."""
    where, params = [], []
    for clause, value in (("t_wall >= ?", since), ("t_wall < ?", until)):
        if value is not None:
            where.append(clause)
            params.append(value)
    sql = f"SELECT count(*) FROM (SELECT 1 FROM turns{' WHERE ' + ' AND '.join(where) if where else ''} LIMIT ?)"
    return int(conn.execute(sql, (*params, limit)).fetchone()[0])


def max_rowid(conn: Connection) -> int:
    """The largest rowid of the turns (as many rows as were ever written, at most: cheap, not a count)."""
    return int(conn.execute("SELECT coalesce(max(rowid), 0) FROM turns").fetchone()[0])


def turn_rows(conn: Connection, fields: Sequence[str], where: str, params: Sequence[Any]) -> Iterator[tuple]:
    """The turns a ``dataset.where_clause`` selects, oldest first, as tuples of ``fields``."""
    return conn.execute(f"SELECT {', '.join(fields)} FROM turns{where} ORDER BY t_wall", params)


def recent_turns(conn: Connection, fields: Sequence[str], where: str, params: Sequence[Any],
                 limit: int) -> list[tuple]:
    """The newest ``limit`` turns a ``dataset.where_clause`` selects, oldest of them first."""
    rows = conn.execute(f"SELECT {', '.join(fields)} FROM turns{where} ORDER BY t_wall DESC, rowid DESC LIMIT ?",
                        (*params, limit)).fetchall()
    return rows[::-1]


def nth_newest_t_wall(conn: Connection, where: str, params: Sequence[Any], n: int) -> float | None:
    """The start time of the ``n``-th newest turn a ``dataset.where_clause`` selects (None: fewer turns)."""
    row = conn.execute(f"SELECT t_wall FROM turns{where} ORDER BY t_wall DESC LIMIT 1 OFFSET ?",
                       (*params, n - 1)).fetchone()
    return None if row is None else float(row[0])


def tenant_key_secret(conn: Connection) -> bytes:
    """The database's own secret for ``tenant_from_key``'s fingerprints (made by its migration 012)."""
    return bytes.fromhex(conn.execute("SELECT value FROM store_meta WHERE key = 'tenant_key_secret'").fetchone()[0])


def vacuum(conn: Connection) -> None:
    """Give the space of deleted rows back to the file system."""
    conn.execute("VACUUM")
