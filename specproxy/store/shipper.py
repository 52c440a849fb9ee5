"""The shipper: a thread per sink that reads the local database forward and sends its rows on.

Why the local database is the outbox: the writer thread commits every turn to SQLite exactly as without
a sink, so traffic never waits on a remote database, and what a sink has not taken yet is simply the
rows past the point it reached. The shipper reads each shipped table (turns, scrapes, a lone turn's
counter deltas) by rowid, after the last rowid its sink took, in batches, hands each batch to the sink,
then notes the batch's last rowid in the same file (``sink_progress``, per sink and table). A crash
between the sink's commit and that note sends the batch again, which the sink ignores (its rows are
keyed by the turn's fleet-wide id): at least once, never twice in the sink. A row the sink refuses is set
aside in ``sink_refused`` with the reason, counted, and passed over; a sink that fails (down, refusing
the credentials) is retried with a growing wait up to ``MAX_WAIT_S``, its reason logged once per cause
and shown on the live page, while the rows wait in the local file.

Rowids only grow while the writer inserts (SQLite gives a new row the largest rowid plus one); should a
``prune`` delete every row of a table, they start again from 1, so a cursor past the largest rowid is
taken back to 0 (sending again what is there costs nothing).
"""

from __future__ import annotations

import logging
import math
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from specproxy.record import FIELD_NAMES
from specproxy.store.db import connect
from specproxy.store.rows import SCRAPE_COLUMNS, TURN_COUNTER_COLUMNS
from specproxy.store.sinks import Identity, Sink, SinkError
from specproxy.wire.os_thread import name_os_thread

log = logging.getLogger("specproxy")

__all__ = ["BATCH", "SHIPPED", "Shipper", "store_id"]

BATCH = 5000  # rows per batch: COPY's cost per row is flat past a few thousand
IDLE_S = 0.2  # caught up: how often to look for new rows
FIRST_WAIT_S = 0.5  # after a sink failed, the first wait before trying again; doubled each time up to
MAX_WAIT_S = 5.0
MEASURE_S = 1.0  # while sending, rows/seconds behind are counted at most this often: counting scans every row
# behind (~20 ms per 100,000), which per 5,000-row batch would cost a backlog of a million rows ~40 µs a turn


@dataclass(frozen=True)
class _Shipped:
    table: str
    columns: tuple[str, ...]  # as the sink gets them
    select: str  # the local columns, in that order ("?" binds the proxy's name)
    key: str  # what names a refused row in sink_refused


def _turn_column(name: str) -> str:
    return "COALESCE(proxy_name, ?)" if name == "proxy_name" else name  # older rows: the proxy's name now


SHIPPED = (
    _Shipped("turns", FIELD_NAMES, ", ".join(map(_turn_column, FIELD_NAMES)), "id"),
    _Shipped("scrapes", ("id", *SCRAPE_COLUMNS), ", ".join(("id", *SCRAPE_COLUMNS)), "id"),
    _Shipped("turn_counters", TURN_COUNTER_COLUMNS, ", ".join(TURN_COUNTER_COLUMNS), "turn_id"),
)


def store_id(conn: sqlite3.Connection) -> str:
    """The local database's own random id (made by its migration 011)."""
    return conn.execute("SELECT value FROM store_meta WHERE key = 'store_id'").fetchone()[0]


class Shipper:
    """Ships one local database to one sink, in its own thread. ``start``, then ``close``; the figures
    (``rows_behind``, ``seconds_behind``, ``batches_failed``, ``rows_set_aside``, ``rows_shipped``,
    ``last_error``) are read from any thread."""

    def __init__(self, db: str | Path, sink: Sink, proxy_name: str, *, batch: int = BATCH, idle_s: float = IDLE_S,
                 max_wait_s: float = MAX_WAIT_S) -> None:
        self.db, self.sink, self.proxy_name = Path(db), sink, proxy_name
        self._batch, self._idle_s, self._max_wait_s = batch, idle_s, max_wait_s
        self._stop = threading.Event()
        self.caught_up = threading.Event()  # set each time nothing is left to send; cleared when a batch goes
        self.rows_behind = 0  # local rows the sink has not taken yet (turns, scrapes, counters)
        self.seconds_behind = 0.0  # age of the oldest turn not yet taken (0 when none waits)
        self.rows_shipped = 0
        self.batches_failed = 0
        self.rows_set_aside = 0
        self.last_error: str | None = None  # None while the sink takes batches
        self._logged: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="specproxy-ship", daemon=True)

    @property
    def name(self) -> str:
        """The sink's name (its URL without a password): the label of this shipper's figures on /metrics."""
        return self.sink.name

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the batch in hand (what is left is sent by the next run: it stays in the file)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        name_os_thread()
        conn = connect(self.db, existing=True)
        try:
            self._loop(conn)
        finally:
            self.sink.close()
            conn.close()

    def _loop(self, conn: sqlite3.Connection) -> None:
        identity = Identity(self.proxy_name, store_id(conn))
        cursors = dict(conn.execute("SELECT tbl, last_rowid FROM sink_progress WHERE sink = ?", (self.sink.name,)))
        wait, is_open = FIRST_WAIT_S, False
        next_measure = 0.0
        while not self._stop.is_set():
            try:
                if not is_open:
                    self.sink.open(identity)
                    is_open = True
                sent = sum(self._ship(conn, shipped, cursors) for shipped in SHIPPED)
            except SinkError as exc:
                is_open = False
                self.sink.close()
                self.batches_failed += 1
                self._failed(str(exc))
                self._measure(conn, cursors)
                self._stop.wait(wait)
                wait = min(wait * 2, self._max_wait_s)
                continue
            wait = FIRST_WAIT_S
            if self.last_error is not None:
                log.warning("sink %s: shipping again", self.sink.name)
                self.last_error = None
                self._logged.clear()
            if not sent or time.monotonic() >= next_measure:  # always once caught up: then it is cheap
                self._measure(conn, cursors)
                next_measure = time.monotonic() + MEASURE_S
            if not sent:
                self.caught_up.set()
                self._stop.wait(self._idle_s)
            else:
                self.caught_up.clear()

    def _failed(self, why: str) -> None:
        self.last_error = why
        if why not in self._logged:  # once per cause, until a batch goes again
            self._logged.add(why)
            log.error("sink %s: %s; turns are kept in the local database and shipped when it takes them",
                      self.sink.name, why)

    def _ship(self, conn: sqlite3.Connection, shipped: _Shipped, cursors: dict[str, int]) -> int:
        """One batch of ``shipped``'s table; the rows sent."""
        after = cursors.get(shipped.table, 0)
        params = (self.proxy_name,) if "?" in shipped.select else ()
        # the batch's last rowid first (from the rowid b-tree alone), so its rows come without a rowid to strip
        (last,) = conn.execute(f"SELECT max(rowid) FROM (SELECT rowid FROM {shipped.table} WHERE rowid > ? "
                               f"ORDER BY rowid LIMIT ?)", (after, self._batch)).fetchone()
        if last is None:
            (largest,) = conn.execute(f"SELECT max(rowid) FROM {shipped.table}").fetchone()
            if after > (largest or 0):  # every row was deleted, and rowids began again
                cursors[shipped.table] = 0
                self._note(conn, shipped.table, 0, [])
            return 0
        values = conn.execute(f"SELECT {shipped.select} FROM {shipped.table} WHERE rowid > ? AND rowid <= ? "
                              f"ORDER BY rowid", (*params, after, last)).fetchall()
        refused = self.sink.send(shipped.table, shipped.columns, values)
        key = shipped.columns.index(shipped.key)
        now = time.time()
        aside = [(self.sink.name, shipped.table, str(values[r.index][key]), r.reason, now) for r in refused]
        for r in refused:
            log.warning("sink %s: a %s row set aside (%s)", self.sink.name, shipped.table, r.reason)
        cursors[shipped.table] = last
        self._note(conn, shipped.table, last, aside)
        self.rows_shipped += len(values) - len(refused)
        self.rows_set_aside += len(refused)
        return len(values)

    def _note(self, conn: sqlite3.Connection, table: str, last_rowid: int, aside: list[tuple]) -> None:
        """How far the sink got (and what it set aside), in one short transaction of the local file."""
        for attempt in range(5):
            try:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("INSERT OR REPLACE INTO sink_progress VALUES (?, ?, ?, ?)",
                             (self.sink.name, table, last_rowid, time.time()))
                conn.executemany("INSERT OR REPLACE INTO sink_refused VALUES (?, ?, ?, ?, ?)", aside)
                conn.execute("COMMIT")
                return
            except sqlite3.OperationalError as exc:  # locked past the busy timeout, a full disk
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                self._failed(f"cannot note progress in {self.db}: {exc}")
                self._stop.wait(0.1 * (attempt + 1))
        # not noted: the batch is sent again next run, which the sink ignores

    def _measure(self, conn: sqlite3.Connection, cursors: dict[str, int]) -> None:
        behind = 0
        for shipped in SHIPPED:
            (n,) = conn.execute(f"SELECT count(*) FROM {shipped.table} WHERE rowid > ?",
                                (cursors.get(shipped.table, 0),)).fetchone()
            behind += n
        (oldest,) = conn.execute("SELECT min(t_wall) FROM turns WHERE rowid > ?", (cursors.get("turns", 0),)).fetchone()
        self.rows_behind = behind
        self.seconds_behind = max(0.0, time.time() - oldest) if oldest is not None and math.isfinite(oldest) else 0.0
