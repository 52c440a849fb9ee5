"""The single writer thread that stores records and scrapes.

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

Why what waits is charged to the memory budget (``wire.memory``): with ``--store-text`` and ``--capture``
each queued item can hold megabytes (a prompt's text, a captured body), and a database that refuses
writes for long (a full disk) let ``queue_size`` of them pile up outside any bound. Each item is charged
by what it holds (``held_bytes``) from ``put`` until it is written or dropped, within ``QUEUE_SHARE`` of
the budget and the budget's large share; past either, a record is queued without its text
(``text_shed``) and a capture is not queued (``captures_shed``), so that the turn's figures are still
stored; past ``queue_size`` the record is dropped and counted as ever.
"""

from __future__ import annotations

import logging
import queue
import re
import sqlite3
import sys
import threading
import time
from collections.abc import Iterable
from contextlib import suppress
from dataclasses import replace
from operator import attrgetter
from pathlib import Path
from typing import Any

from specproxy.record import FIELD_NAMES, Record
from specproxy.store.db import SQLITE_FULL, open_store
from specproxy.store.retention import ScrapeRetention
from specproxy.wire import memory
from specproxy.wire.os_thread import name_os_thread

log = logging.getLogger("specproxy")

__all__ = ["COMMIT_GAP_S", "INSERT_TURN", "QUEUE_SHARE", "Writer", "held_bytes", "record_row"]


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


INSERT_TURN = f"INSERT OR REPLACE INTO turns ({', '.join(FIELD_NAMES)}) VALUES ({', '.join('?' * len(FIELD_NAMES))})"


_WAKE = object()  # put by close(): the writer thread wakes at once instead of at its next poll
COMMIT_GAP_S = 0.05  # at most one commit per this long: records that come meanwhile go in the next together,
GAP_BATCH = 32  # unless this many wait already: enough to make a commit cheap per row (and no cap on throughput)
RETRY_S = (0.2, 0.4, 0.8, 1.6)  # waits between attempts at a batch the database refuses, while none of it fits
STOP_RETRY_S = 5.0  # closing: how long a refused batch is retried before it is dropped (counted, logged)
QUEUE_SHARE = 0.25  # of the memory budget: what records' texts and captured bodies waiting here may hold


def _count(n: int, one: str, many: str = "") -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def held_bytes(item: Any) -> int:
    """What a queued item holds that can be large, in bytes of memory: a record's stored texts, a
    ``(sql, params)`` item's text and bytes parameters (a captured body). The same for an item whenever
    it is asked (records and tuples do not change), so a charge is given back exactly."""
    if isinstance(item, Record):
        return ((sys.getsizeof(item.prompt_text) if item.prompt_text is not None else 0)
                + (sys.getsizeof(item.response_text) if item.response_text is not None else 0))
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], tuple):
        return sum(len(p) for p in item[1] if isinstance(p, (bytes, bytearray, memoryview))) + sum(
            sys.getsizeof(p) for p in item[1] if isinstance(p, str) and len(p) > 256)
    return 0


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
        self._lost_lock = threading.Lock()
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
        self._lock = threading.Lock()  # over held_total: put (the loop) adds, the writer thread gives back
        self.held_total = 0  # bytes the queued and held items hold, charged to the memory budget
        self.text_shed = 0  # records queued without their text: the memory budget had no room for it
        self.captures_shed = 0  # captured bodies not queued: the memory budget had no room for them
        self._full = False  # the latest refusal was for want of room (worth splitting the batch for)
        self._logged: set[str] = set()  # the causes of failure logged since the last write that succeeded
        self._thread.start()

    def put(self, item: Record | tuple[str, tuple]) -> bool:
        """Enqueue a Record (or a ``(sql, params)`` pair); False (and counted) when the queue is full. From
        any thread (the measuring thread puts records, the event loop scrapes)."""
        if self._stop.is_set() or self._queue.qsize() >= self._queue_size:  # closing: not waited for
            self._lost(1)
            return False
        n = held_bytes(item)
        if n and not self._charge(n):  # the budget has no room: the text or the body goes, the figures stay
            if not isinstance(item, Record):
                with self._lost_lock:  # two threads put
                    self.captures_shed += 1
                self._note_shed()
                return False
            with self._lost_lock:
                self.text_shed += 1
            self._note_shed()
            item = replace(item, prompt_text=None, response_text=None)
        self._queue.put(item)
        return True

    def _charge(self, n: int) -> bool:
        """Charge ``n`` bytes of a queued item: within ``QUEUE_SHARE`` of the budget and its large share."""
        full = memory.limit()[1]
        with self._lock:
            if full and self.held_total + n > full * QUEUE_SHARE:
                return False
            if not memory.take(n):
                return False
            self.held_total += n
            return True

    def _release(self, items: Iterable) -> None:
        """Give back the charge of items written or dropped."""
        n = sum(map(held_bytes, items))
        if n:
            with self._lock:
                self.held_total -= n
            memory.give(n)

    _shed_logged = False

    def _note_shed(self) -> None:
        if not self._shed_logged:  # once: the counts say how many since
            self._shed_logged = True
            log.error("database %s: the writer's queue holds its share of the memory budget; records are "
                      "queued without their text and captured bodies are not kept (counted: text_shed, "
                      "captures_shed)", self.path)

    def _lost(self, n: int) -> None:
        with self._lost_lock:  # ``+=`` is not atomic, and two threads may drop at once
            self.dropped += n

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
        with suppress(queue.Empty):
            while True:
                item = self._queue.get_nowait()
                if item is not _WAKE:
                    pending.append(item)
        self._held = 0
        turns = sum(isinstance(i, Record) for i in pending)
        captures = sum(1 for i in pending if not isinstance(i, Record) and " captures " in i[0])
        self._lost(len(pending))
        self._release(pending)
        others = len(pending) - turns - captures  # scrapes
        log.error("database %s: %d records could not be written before shutdown and are lost: %s, %s, %s (%s)",
                  self.path, len(pending), _count(turns, "turn"), _count(captures, "captured body", "captured bodies"),
                  _count(others, "scrape"), self.last_error)

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
                self._release(items[:n])
                items = items[n:]
            self._held = len(skipped) + len(items)
        return skipped

    def _write(self, items: list) -> bool:
        records = [i for i in items if isinstance(i, Record)]
        other = [i for i in items if not isinstance(i, Record)]
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.executemany(INSERT_TURN, map(_raw_row, records))
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
            self._full = getattr(exc, "sqlite_errorcode", SQLITE_FULL) & 0xFF == SQLITE_FULL
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
                self._conn.execute(INSERT_TURN, row)
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
