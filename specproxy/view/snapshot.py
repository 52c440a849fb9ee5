"""What one picture of the database shows: the report, the numbers behind its charts, the newest turns.

Why one function for the live page and ``report --html``: both draw the same window the same way, and
every figure comes from ``analyze`` (``build_report``, ``pictures``), read from the database as
``specproxy report`` reads it; nothing here computes a figure.
"""

from __future__ import annotations

from typing import Any

from specproxy.analyze.pictures import pictures
from specproxy.analyze.report import REPORT_COLUMNS, build_report
from specproxy.config import Slo
from specproxy.record import FIELD_NAMES
from specproxy.store.source import Source, Window

__all__ = ["RECENT_TURNS", "RECORD_FIELDS", "snapshot"]

RECENT_TURNS = 40
# a turn's record as the page shows it when clicked: every field but the stored texts (opt-in, and a
# page is easily shared)
RECORD_FIELDS = tuple(f for f in FIELD_NAMES if f not in ("prompt_text", "response_text"))


def snapshot(store: Source, *, source: str, label: str | None = None, since: float | None = None,
             until: float | None = None, recent: int = RECENT_TURNS, slo: Slo | None = None) -> dict[str, Any]:
    """The window's report (with ``slo``, its SLO section), pictures and newest turns, from one load of ``store``."""
    window = Window(label, since, until)
    data = store.load(window, REPORT_COLUMNS, server=True, context=True)
    report = build_report(data, source=source, slo=slo)
    rows = store.recent(window, RECORD_FIELDS, recent)
    return {"report": report, "pictures": pictures(data.turns), "recent": [dict(zip(RECORD_FIELDS, r)) for r in rows]}
