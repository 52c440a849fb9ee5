"""What one picture of the database shows: the report, the numbers behind its charts, the newest turns.

Why one function for the live page and ``report --html``: both draw the same window the same way, and
every figure comes from ``analyze`` (``build_report``, ``pictures``), read from the database as
``specproxy report`` reads it; nothing here computes a figure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from specproxy.analyze.pictures import pictures
from specproxy.analyze.report_data import build_report, report_columns
from specproxy.analyze.turn_diff import recent_changes, render_diff
from specproxy.analyze.slo import met
from specproxy.config import Slo
from specproxy.record import FIELD_NAMES
from specproxy.store.source import Source, Window

__all__ = ["RECENT_TURNS", "RECORD_FIELDS", "snapshot"]

RECENT_TURNS = 40
RECENT_CONTEXT = 40  # turns read before the shown ones, so that a shown turn's session's previous turn is known
# a turn's record as the page shows it when clicked: every field but the stored texts (opt-in, and a
# page is easily shared)
RECORD_FIELDS = tuple(f for f in FIELD_NAMES if f not in ("prompt_text", "response_text"))


def snapshot(store: Source, *, source: str, label: str | None = None, since: float | None = None,
             until: float | None = None, recent: int = RECENT_TURNS, prices: Mapping | None = None,
             by: str | None = None, slo: Slo | None = None) -> dict[str, Any]:
    """The window's report, pictures and newest turns, from one load of ``store``; with ``prices`` its
    cost, with ``by`` its table per group, with ``slo`` its SLO section and each newest turn judged
    (``build_report``)."""
    window = Window(label, since, until)
    with store.consistent():  # the figures and the newest turns from one committed state
        data = store.load(window, report_columns(prices, by), server=True, context=True)
        rows = [dict(zip(RECORD_FIELDS, r)) for r in store.recent(window, RECORD_FIELDS, recent + RECENT_CONTEXT)]
    report = build_report(data, source=source, prices=prices, by=by, slo=slo)
    changes = recent_changes(rows, (report.get("prefix_cache") or {}).get("fit"))[-recent:] if rows else []
    turns = rows[-recent:]
    if slo is not None:  # each newest turn judged by the same rule as the report's share: not a stored field
        nan = float("nan")
        judged = met(slo, np.array([t["outcome"] for t in turns], dtype=object),
                     *(np.array([nan if t[f] is None else t[f] for t in turns], dtype=float)
                       for f in ("ttft_s", "decode_tps", "total_s")),
                     np.array([t["label"] for t in turns], dtype=object))
        for t, m in zip(turns, judged.tolist()):
            t["slo_met"] = None if m != m else bool(m)
    return {"report": report, "pictures": pictures(data.turns), "recent": turns,
            "changes": [None if c is None else {**c, "text": render_diff(c)} for c in changes]}
