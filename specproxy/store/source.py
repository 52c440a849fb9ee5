"""The one load path from a store to the analysis: a window's turns and scrapes, read once, as columns.

Why: the analysis (``analyze/``) computes in memory and never holds a database connection, so that
a second database (PostgreSQL for a fleet) adds loading queries only, never a second copy of an
analysis query. A store implements the few primitive reads of ``Source`` below; ``Source.load``
composes them the same way for every store, and hands the analysis a ``WindowData``.

What a store must return (every implementation; ``tests/unit/test_source.py`` holds the SQLite one to it):

* ``turns(window, columns) -> dataset.Turns``: the measured turns (``measured`` not false: the rows of
  other paths carry no figures) whose ``t_wall`` is in ``[since, until)`` and whose ``label`` equals the
  window's label (when given), ordered by ``t_wall`` then insertion order. ``num`` holds one
  ``float64`` array per numeric column asked (``dataset.NUMERIC``; SQL NULL is ``nan``, never 0) and
  always ``t_wall`` and ``rowid``; ``num["rowid"]`` is ``int64``: a key unique in the store that grows
  in insertion order (SQLite's rowid; a PostgreSQL store its own bigserial), used for ties and to join
  lone-turn counters. ``txt`` holds one ``object`` array per text column asked (``dataset.TEXT``),
  ``str`` or ``None`` for NULL. Filters (label, window) are applied in the query, not after.
* ``scrapes(t0, t1) -> Scrapes``: the stored scrapes with ``t0 <= t_wall <= t1``, oldest first, all
  of them, failed ones included (``error`` not None, or ``server_kind`` None).
* ``scrape_time(t, after=..., ok=..., not_after=...)``: the wall time of the last stored scrape at or
  before ``t`` (``after`` false), or of the first one sent at or after ``t`` (``t_wall - latency_s``,
  a NULL latency read as 0) and not after ``not_after`` (``after`` true); a successful one (``error``
  NULL and ``server_kind`` not NULL) when ``ok``; None when there is none. Why the sending time: a
  scrape's page was built between its sending and its ``t_wall`` (the headers' arrival), so only one
  sent after ``t`` is sure to count what happened before ``t`` (``Scrapes.sent``).
* ``lone_joins(window) -> LoneJoins``: the lone-turn counter deltas (``turn_counters``) of the turns
  the window selects, as the joined turn's ``rowid`` and its MAL (``nan`` for NULL), in the order
  the deltas were stored.
* ``unmeasured(window) -> int``: rows of other paths (``measured`` false) in the window.
* ``database() -> dict``: the whole store (read only when a window selects nothing): ``n`` measured
  turns, ``first_t_wall``/``last_t_wall`` (None when empty), ``other`` rows of other paths, ``labels``:
  the labels measured turns carry, sorted.
* ``recent(window, fields, limit) -> list[tuple]``: the newest ``limit`` turns of the window (measured),
  oldest of them first, as tuples of ``fields`` (record field names); ``nth_newest_t_wall(window, n)``:
  the ``t_wall`` of the window's ``n``-th newest turn, or None.
* ``consistent()``: a context in which every read sees one committed state of the store, for a
  picture made of several reads (the live page's figures and its newest turns must not count a turn
  committed between them).

A store's missing table (an older database) reads as empty, never as an error.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specproxy.store.dataset import Turns

__all__ = ["SCRAPE_FIELDS", "LoneJoins", "Scrapes", "Source", "Window", "WindowData"]

# the numeric fields of a stored scrape that the server section reads (float64, nan for NULL)
SCRAPE_FIELDS = ("requests_running", "requests_waiting", "generation_tokens_total", "prompt_tokens_total",
                 "spec_drafts_total", "spec_draft_tokens_total", "spec_accepted_tokens_total",
                 "spec_accept_length", "spec_accept_rate", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "latency_s")


@dataclass(frozen=True)
class Window:
    """Which turns: one label (None: any) and a wall-time window ``[since, until)`` in epoch seconds."""

    label: str | None = None
    since: float | None = None
    until: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "since": self.since, "until": self.until}


@dataclass
class Scrapes:
    """Stored scrapes as columns, oldest first: ``t_wall`` float64; ``instance_id``, ``server_kind``,
    ``error`` object arrays (None for NULL); ``num[field]`` float64 (nan for NULL) per SCRAPE_FIELDS."""

    t_wall: np.ndarray
    instance_id: np.ndarray
    server_kind: np.ndarray
    error: np.ndarray
    num: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.t_wall)

    @classmethod
    def empty(cls) -> Scrapes:
        none = np.empty(0, dtype=object)
        return cls(np.empty(0), none, none, none, {f: np.empty(0) for f in SCRAPE_FIELDS})

    @classmethod
    def from_rows(cls, rows: Sequence[tuple]) -> Scrapes:
        """From ``(t_wall, instance_id, server_kind, error, *SCRAPE_FIELDS)`` tuples."""
        if not rows:
            return cls.empty()
        # one 2-D object array, then the numbers cast at once (None becomes nan): a month is half a million
        # scrapes, and transposing the tuples in Python cost more than reading them
        table = np.array(rows, dtype=object)
        nums = table[:, [0, *range(4, 4 + len(SCRAPE_FIELDS))]].astype(float).T
        return cls(np.ascontiguousarray(nums[0]), table[:, 1].copy(), table[:, 2].copy(), table[:, 3].copy(),
                   {f: np.ascontiguousarray(nums[1 + i]) for i, f in enumerate(SCRAPE_FIELDS)})

    def ok(self) -> np.ndarray:
        """Which scrapes succeeded (no error, a server kind)."""
        return np.equal(self.error, None) & np.not_equal(self.server_kind, None)

    def sent(self) -> np.ndarray:
        """When each scrape's request was sent (wall time): its page was built between then and its
        ``t_wall``, when the headers came. A scrape stored without its latency (a failed one, or one from
        before the column) reads as sent at its ``t_wall``."""
        return self.t_wall - np.nan_to_num(self.num["latency_s"])


@dataclass
class LoneJoins:
    """Lone turns joined with their own counter deltas: the turn's ``rowid`` (int64) and MAL (float64,
    nan for NULL), in the order the deltas were stored."""

    rowid: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    mal: np.ndarray = field(default_factory=lambda: np.empty(0))

    @classmethod
    def from_rows(cls, rows: Sequence[tuple]) -> LoneJoins:
        """From ``(rowid, mal)`` rows as a store's query returns them (MAL None for NULL)."""
        if not rows:
            return cls()
        return cls(np.array([r[0] for r in rows], dtype=np.int64), np.array([r[1] for r in rows], dtype=float))


@dataclass
class WindowData:
    """Everything the analysis reads about one window, loaded once.

    ``scrapes``: every stored scrape the server section may need (a superset of the span it reads
    between: see ``Source.load``), or None when the server section was not asked for.
    ``database``: the whole store's summary (``Source.database``), only when the window selects no turn.
    """

    window: Window
    turns: Turns
    scrapes: Scrapes | None = None
    lone: LoneJoins | None = None
    unmeasured: int | None = None
    database: dict[str, Any] | None = None


class Source(ABC):
    """A store the analysis reads: the primitive reads (abstract) and ``load``, which composes them."""

    @abstractmethod
    def turns(self, window: Window, columns: Sequence[str] | None = None) -> Turns: ...

    @abstractmethod
    def scrapes(self, t0: float, t1: float) -> Scrapes: ...

    @abstractmethod
    def scrape_time(self, t: float, *, after: bool, ok: bool = True, not_after: float | None = None) -> float | None: ...

    @abstractmethod
    def lone_joins(self, window: Window) -> LoneJoins: ...

    @abstractmethod
    def unmeasured(self, window: Window) -> int: ...

    @abstractmethod
    def database(self) -> dict[str, Any]: ...

    @abstractmethod
    def recent(self, window: Window, fields: Sequence[str], limit: int) -> list[tuple]: ...

    @abstractmethod
    def nth_newest_t_wall(self, window: Window, n: int) -> float | None: ...

    @abstractmethod
    def consistent(self) -> AbstractContextManager[None]: ...

    def labels(self) -> list[str]:
        return list(self.database()["labels"])

    def load(self, window: Window = Window(), columns: Sequence[str] | None = None, *,
             server: bool = False, context: bool = False) -> WindowData:
        """The window's turns (``columns``: None for all); with ``server``, the scrapes and lone-turn joins
        the report's server section reads; with ``context``, the rows of other paths in the window; and,
        when the window selects no turn, the whole store's summary (why it is empty)."""
        if server and columns is not None:  # what the scrape span is fixed by
            columns = tuple(dict.fromkeys((*columns, "total_s")))
        turns = self.turns(window, columns)
        data = WindowData(window, turns)
        if not len(turns):
            data.database = self.database()
        if context:
            data.unmeasured = self.unmeasured(window)
        if server:
            data.scrapes = self._server_scrapes(turns, window.until)
            data.lone = self.lone_joins(window)
        turns.release_pages()  # the passes above read whole columns the figures read again when they need them
        return data

    def _server_scrapes(self, turns: Turns, until: float | None) -> Scrapes:
        """Every scrape the server section can read for any subset of ``turns``: from the last successful
        scrape at or before the first turn's start (or the last attempt, or that start) to the first
        scrape, successful or not, at or after the last turn's end (not past ``until``)."""
        if not len(turns):
            return Scrapes.empty()
        start = turns.num["t_wall"]
        end = start + np.nan_to_num(turns.num["total_s"])
        first, last = float(np.min(start)), float(np.max(end))
        stop = last if until is None else min(last, until)
        lo = self.scrape_time(first, after=False)
        if lo is None:
            lo = self.scrape_time(first, after=False, ok=False)
        lo = first if lo is None else min(lo, first)
        ends = [stop, self.scrape_time(last, after=True, not_after=until),
                self.scrape_time(last, after=True, ok=False, not_after=until)]
        hi = max(t for t in ends if t is not None)
        return self.scrapes(lo, hi)
