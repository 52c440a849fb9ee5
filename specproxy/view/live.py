"""The live page's pictures for a running proxy (``serve.admin.Pages``), read from its own database.

Why from the database rather than from records in memory: the page then shows exactly what
``specproxy report`` says of the same window (the server's counters and the lone turns' joins are only
there), and it costs the proxy nothing between renderings. The proxy calls these methods in a thread,
at most once a second and only while someone watches (``serve/admin.py``).
"""

from __future__ import annotations

import time

from specproxy.store.db import connect
from specproxy.view.html import document, fragment
from specproxy.view.snapshot import snapshot

__all__ = ["LivePages", "WINDOW_S"]

WINDOW_S = 15 * 60.0  # the live page shows the last this many seconds of turns


class LivePages:
    def __init__(self, db: str, *, window_s: float = WINDOW_S) -> None:
        self.db = db
        self.window_s = window_s

    def _snapshot(self) -> dict:
        conn = connect(self.db, readonly=True)
        try:
            return snapshot(conn, source=self.db, since=time.time() - self.window_s)
        finally:
            conn.close()

    def document(self) -> str:
        title = f"specproxy live: the last {self.window_s / 60:g} minutes of {self.db}"
        return document(self._snapshot(), live=True, title=title)

    def fragment(self) -> str:
        return fragment(self._snapshot())
