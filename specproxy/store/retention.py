"""Bounding the database: delete old scrapes (by the writer, on a schedule) and old rows by hand (prune).

Why: the ``scrapes`` table gains a row every ``scrape_interval_s`` whether or not anyone uses the
proxy (17,280 rows a day at 5 s), each holding the server's whole ``/metrics`` page; kept forever it
grows without bound. Turns are the measurements themselves, so only ``specproxy prune --turns``
deletes them, never a schedule.

Why in chunks: the writer that inserts turns is the one that deletes, and a long DELETE would hold
the database's write lock while turns wait in its queue (and a full queue drops them). Each chunk is
its own short transaction; the writer deletes one chunk between batches, so turns wait at most one
chunk. ``prune`` deletes in the same chunks, so a ``serve`` writing beside it is not locked out.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["PRUNE_CHUNK", "PRUNE_EVERY_S", "ScrapeRetention", "delete_scrapes", "delete_turns"]

PRUNE_CHUNK = 1000  # rows per transaction: an hour of scrapes at 5 s (720) in one, and a short lock for the turns
PRUNE_EVERY_S = 3600.0  # between the writer's scheduled deletes, once nothing old is left
RETRY_S = 60.0  # after the database refused a delete (locked, full)


def delete_scrapes(conn: sqlite3.Connection, before: float, limit: int | None = None) -> int:
    """Delete up to ``limit`` scrapes with ``t_wall < before`` in one transaction; the number deleted."""
    with _transaction(conn):
        cur = conn.execute("DELETE FROM scrapes WHERE rowid IN (SELECT rowid FROM scrapes WHERE t_wall < ? LIMIT ?)",
                           (before, limit or PRUNE_CHUNK))
        return cur.rowcount


def delete_turns(conn: sqlite3.Connection, before: float, limit: int | None = None) -> tuple[int, int]:
    """Delete up to ``limit`` turns with ``t_wall < before``, their counter joins (turn_counters) and their
    captured request bodies (captures), in one transaction; (turns, turn_counters) deleted."""
    with _transaction(conn):
        rows = conn.execute("SELECT rowid, id FROM turns WHERE t_wall < ? LIMIT ?",
                            (before, limit or PRUNE_CHUNK)).fetchall()
        changes = conn.total_changes
        conn.executemany("DELETE FROM turn_counters WHERE turn_id = ?", [(turn_id,) for _, turn_id in rows])
        counters = conn.total_changes - changes
        conn.executemany("DELETE FROM captures WHERE turn_id = ?", [(turn_id,) for _, turn_id in rows])
        conn.executemany("DELETE FROM turns WHERE rowid = ?", [(rowid,) for rowid, _ in rows])
        return len(rows), counters


@contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on an error (the connection is in autocommit mode)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # the error that got us here is the one to report
        raise
    conn.execute("COMMIT")


class ScrapeRetention:
    """When the writer deletes scrapes older than ``days`` (0: never): at start-up, then hourly; again
    at once while a chunk came back full (more old rows are waiting)."""

    def __init__(self, days: float, *, wall=time.time, mono=time.monotonic) -> None:
        self.keep_s = days * 86400.0
        self._wall, self._mono = wall, mono
        self._next = mono()  # due at start-up
        self.deleted = 0
        self.last_error: str | None = None

    def run_if_due(self, conn: sqlite3.Connection) -> int:
        """Delete one chunk if it is time; the number of rows deleted."""
        if self.keep_s <= 0 or self._mono() < self._next:
            return 0
        try:
            n = delete_scrapes(conn, self._wall() - self.keep_s)
        except sqlite3.Error as exc:  # locked, disk full: never worth losing the writer (and turns) over
            self.last_error = str(exc)
            self._next = self._mono() + RETRY_S
            return 0
        self.deleted += n
        self._next = self._mono() + (0.0 if n >= PRUNE_CHUNK else PRUNE_EVERY_S)
        return n
