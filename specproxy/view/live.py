"""The live page's pictures for a running proxy (``serve.admin.Pages``), read from its own database.

Why from the database rather than from records in memory: the page then shows exactly what
``specproxy report`` says of the same window (the server's counters and the lone turns' joins are only
there), and it costs the proxy nothing between renderings. The proxy calls these methods in a thread,
only while someone watches, and spaces them by what they cost (``serve/admin.py`` ``render_gap``: at
most once a second, and at most half a percent of one core).

Why at most ``MAX_TURNS`` turns: a picture's CPU grows with the turns it reads (the report over them
and their columns from SQLite), and the share rule turns that cost into the wait before the next picture.
Under heavy traffic the last 15 minutes hold 100,000 turns and more, which would leave the page still
for minutes; the newest ``MAX_TURNS`` keep a picture's cost bounded whatever the traffic (and the time
it holds the interpreter lock, which the proxy's event loop and measuring wait for), so the page
stays live. The window drawn is said on the page and is an ordinary ``since``: ``specproxy report
--since`` that time gives the same figures. ``scripts/bench_page.py`` measures a picture's cost.
"""

from __future__ import annotations

import time

from html import escape
from typing import Any

from specproxy.config import Slo
from specproxy.store.source import Window
from specproxy.store.sqlite_source import SQLiteSource
from specproxy.view.html import document, fragment
from specproxy.view.snapshot import snapshot

__all__ = ["MAX_TURNS", "LivePages", "WINDOW_S"]

WINDOW_S = 15 * 60.0  # the live page shows the last this many seconds of turns
MAX_TURNS = 500  # and of those at most the newest this many


class LivePages:
    """``writer``: the proxy's ``store.writer.Writer``, whose counts the page's store line shows (what waits,
    what the database refused, what was dropped): the pictures come from the database, and a database
    that refuses writes would otherwise leave the page still and silent."""

    def __init__(self, db: str, *, window_s: float = WINDOW_S, max_turns: int = MAX_TURNS,
                 writer: Any = None, shippers: list | None = None, slo: Slo | None = None) -> None:
        self.db = db
        self.slo = slo  # serve's slo: the page's window judged by it (analyze/slo.py), as report --slo does
        self.window_s = window_s
        self.max_turns = max_turns
        self.writer = writer
        self.shippers = shippers or []  # store.shipper.Shipper: a line each, the sink's state

    def store_line(self) -> str:
        w = self.writer
        if w is None:
            return ""
        text = (f"store: {w.written} records written, {w.pending} waiting, {w.dropped} dropped, "
                f"{w.write_failures} writes refused")
        if w.write_failures or w.dropped:
            why = f" (latest: {w.last_error})" if w.last_error else ""
            line = f'<p class="error" id="store">{escape(text + why)}</p>'
        else:
            line = f'<p class="muted" id="store">{escape(text)}</p>'
        return line + "".join(self.sink_line(s) for s in self.shippers)

    @staticmethod
    def sink_line(s: Any) -> str:
        """A sink's state: what it took, what waits for it, and why it takes nothing now, if it does not."""
        text = (f"sink {s.sink.name}: {s.rows_shipped} rows shipped, {s.rows_behind} behind "
                f"({s.seconds_behind:.0f} s), {s.rows_set_aside} set aside, {s.batches_failed} batches failed")
        if s.last_error is not None:
            return f'<p class="error" id="sink">{escape(f"{text}: {s.last_error}")}</p>'
        return f'<p class="muted" id="sink">{escape(text)}</p>'

    def _snapshot(self) -> dict:
        with SQLiteSource(self.db) as store:
            since = time.time() - self.window_s
            nth = store.nth_newest_t_wall(Window(since=since), self.max_turns)
            return snapshot(store, source=self.db, since=since if nth is None else max(since, nth), slo=self.slo)

    def document(self) -> str:
        title = (f"specproxy live: the last {self.window_s / 60:g} minutes of {self.db} "
                 f"(at most its newest {self.max_turns} turns)")
        return document(self._snapshot(), live=True, title=title, note=self.store_line())

    def fragment(self) -> str:
        return fragment(self._snapshot(), self.store_line())
