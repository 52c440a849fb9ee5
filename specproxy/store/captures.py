"""Captured request bodies (``serve --capture``): written beside their turns, read back for replay.

Why a table of its own and not a column of ``turns``: a body can be megabytes (a coding agent's
whole conversation), the reports read ``turns`` column by column and must not page through them,
and capture is opt-in, so most databases hold no row here at all. Only the body is kept, as the
bytes the client sent (with the Content-Encoding it said they have); never a header, so an API key
cannot end up here. A capture shares its turn's id, so a turn and its body are deleted together
(``retention.delete_turns``).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Captured", "capture_item", "captured_requests", "count_captures"]

_INSERT = ("INSERT OR REPLACE INTO captures (turn_id, t_wall, method, path, content_encoding, body) "
           "VALUES (?, ?, ?, ?, ?, ?)")


@dataclass(frozen=True, slots=True)
class Captured:
    turn_id: str
    t_wall: float
    method: str
    path: str
    content_encoding: str
    body: bytes


def capture_item(turn_id: str, t_wall: float, method: str, path: str, content_encoding: str,
                 body: bytes) -> tuple[str, tuple]:
    """The ``(sql, params)`` pair the writer thread takes (``Writer.put``): the insert runs there, in the
    same batches as the turns, so capturing adds one queue put on the event loop and nothing else."""
    return _INSERT, (turn_id, t_wall, method, path, content_encoding or "", body)


def captured_requests(conn: sqlite3.Connection, *, label: str | None = None, since: float | None = None,
                      until: float | None = None) -> Iterator[Captured]:
    """The captured bodies in the order they were sent (wall time), optionally only those whose turn has
    ``label``, or that were sent in [since, until). A database without the table has none."""
    where, params = [], []
    if label is not None:
        where.append("t.label = ?")
        params.append(label)
    if since is not None:
        where.append("c.t_wall >= ?")
        params.append(since)
    if until is not None:
        where.append("c.t_wall < ?")
        params.append(until)
    sql = ("SELECT c.turn_id, c.t_wall, c.method, c.path, c.content_encoding, c.body FROM captures c "
           "LEFT JOIN turns t ON t.id = c.turn_id"
           + (f" WHERE {' AND '.join(where)}" if where else "") + " ORDER BY c.t_wall, c.rowid")
    try:
        rows = conn.execute(sql, params)
    except sqlite3.OperationalError:  # a database from before captures existed
        return
    for turn_id, t_wall, method, path, encoding, body in rows:
        yield Captured(turn_id, t_wall, method, path, encoding or "", bytes(body or b""))


def count_captures(conn: sqlite3.Connection) -> int:
    try:
        return int(conn.execute("SELECT count(*) FROM captures").fetchone()[0])
    except sqlite3.OperationalError:
        return 0
